"""The router's logits on CUDA: the FP32 GEMM (HF reference) and the BF16 tensor-core GEMM with FP32
output (router_gemm='bf16') against float64; routing and compiled routing of the BF16 form."""

import pytest
import torch
import torch.nn.functional as F

from latent_moe_fusion.model.router import route, router_logits

pytestmark = pytest.mark.gpu

H, E, TOP_K = 7168, 896, 16
# rel L2 to float64 on the H200 (K = 7168): FP32 GEMM 1.1e-7 .. 2.5e-7; BF16 tensor cores 1.4e-6 (M = 1)
# .. 7.9e-6 (M = 4096): their FP32 accumulation keeps fewer bits than an FP32 FMA chain.
FP32_TOL, BF16_TOL = 1e-6, 3e-5


def _inputs(m):
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(E, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    bias = torch.randn(E, device="cuda") * 1e-2
    return x, w, bias


def _rel_l2(t, ref):
    return float((t.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("m", [1, 8, 37, 4096])
def test_logits_against_float64(m, rng_seed):
    x, w, _ = _inputs(m)
    ref = x.double() @ w.double().t()
    for gemm, tol in (("fp32", FP32_TOL), ("bf16", BF16_TOL)):
        logits = router_logits(x, w, gemm)
        assert logits.dtype == torch.float32 and logits.shape == (m, E)
        err = _rel_l2(logits, ref)
        assert err < tol, f"{gemm}: rel L2 {err:.3g} to float64 (limit {tol:g})"
    assert torch.equal(router_logits(x, w, "fp32"), F.linear(x.float(), w.float()))


def test_bf16_routing_agrees_with_the_fp32_gemm(rng_seed):
    x, w, bias = _inputs(2048)
    ids, weights = route(x, w, bias, TOP_K, 1.0, "bf16")
    ref_ids, _ = route(x, w, bias, TOP_K, 1.0, "fp32")
    same = (ids.sort(dim=-1).values == ref_ids.sort(dim=-1).values).all(dim=-1)
    # only near-ties of the 16th and 17th biased score may resolve the other way
    assert same.float().mean() > 0.995, f"{int((~same).sum())} of 2048 tokens routed differently"
    torch.testing.assert_close(weights.sum(-1), torch.ones(2048, device="cuda"))


@pytest.mark.parametrize("gemm", ["fp32", "bf16"])
def test_compiled_route_equals_eager(gemm, rng_seed):
    x, w, bias = _inputs(32)
    eager = route(x, w, bias, TOP_K, 1.0, gemm)
    compiled = torch.compile(route, dynamic=False)(x, w, bias, TOP_K, 1.0, gemm)
    assert torch.equal(eager[0].sort(-1).values, compiled[0].sort(-1).values)
    torch.testing.assert_close(eager[1].sort(-1).values, compiled[1].sort(-1).values)
