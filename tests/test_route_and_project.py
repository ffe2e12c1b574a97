"""lmf::route_and_project on the CPU: its outputs are those of the calls it replaces (the router GEMM, the
route, the down-projection), z against float64, opcheck, bad arguments and the side-by-side switch."""

import pytest
import torch

from latent_moe_fusion.model.router import route_from_logits, router_logits
from latent_moe_fusion.ops.common.route_math import localize, route_reference
from latent_moe_fusion.ops.routed.router_fused.route_and_project import (
    OVERLAP_MAX_TOKENS,
    overlap_order,
    overlap_wanted,
)
from tests.bad_arguments import assert_refused

OP = torch.ops.lmf.route_and_project
H, E, L, K = 96, 40, 48, 6


def _inputs(m, dtype, gen):
    x = torch.randn(m, H, generator=gen).to(dtype)
    gate = (torch.randn(E, H, generator=gen) * H**-0.5).to(dtype)
    bias = torch.randn(E, generator=gen) * 0.1
    w_down = (torch.randn(L, H, generator=gen) * H**-0.5).to(dtype)
    return x, gate, bias, w_down


@pytest.mark.parametrize("dtype, router_gemm", [(torch.bfloat16, "fp32"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")])
@pytest.mark.parametrize("m, first, num_local", [(1, 0, E), (7, 10, 10)])
def test_outputs_are_those_of_the_calls_it_replaces(rng_seed, dtype, router_gemm, m, first, num_local):
    gen = torch.Generator().manual_seed(rng_seed)
    x, gate, bias, w_down = _inputs(m, dtype, gen)
    ids, weights, z = OP(x, gate, bias, w_down, router_gemm, K, 1e-20, 2.5, first, num_local)
    # the unfused model: router_logits (on CPU every router GEMM is the FP32 one), route, F.linear
    want_ids, want_weights = route_reference(router_logits(x, gate, router_gemm), bias, K, 1e-20, 2.5, first, num_local)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert torch.equal(z, torch.nn.functional.linear(x, w_down)) and z.dtype == dtype
    # the selection is the model's (CPU topk orders slots its own way: compare as sets)
    model_ids, _ = route_from_logits(router_logits(x, gate, "fp32"), bias, K, 2.5)
    model_ids = localize(model_ids, first, num_local)
    assert torch.equal(ids.sort(-1).values, model_ids.sort(-1).values)
    z64 = x.double() @ w_down.double().t()
    rel = float((z.double() - z64).norm() / z64.norm())
    assert rel < (1e-6 if dtype == torch.float32 else 8e-3), rel


def test_empty_batch():
    x, gate, bias, w_down = _inputs(1, torch.bfloat16, torch.Generator().manual_seed(0))
    ids, weights, z = OP(x[:0], gate, bias, w_down, "fp32", K, 1e-20, 1.0, 0, E)
    assert ids.shape == (0, K) and weights.shape == (0, K) and z.shape == (0, L)


@pytest.mark.parametrize("dtype, router_gemm", [(torch.bfloat16, "bf16"), (torch.float32, "fp32")])
def test_opcheck(rng_seed, dtype, router_gemm):
    args = (*_inputs(5, dtype, torch.Generator().manual_seed(rng_seed)), router_gemm, K, 1e-20, 1.0, 8, 16)
    result = torch.library.opcheck(OP, args)
    assert result and all(v == "SUCCESS" for v in result.values()), result


def _good():
    x, gate, bias, w_down = _inputs(4, torch.bfloat16, torch.Generator().manual_seed(1))
    return dict(x=x, gate_weight=gate, correction_bias=bias, w_down=w_down, router_gemm="bf16", top_k=K,
                renorm_eps=1e-20, scaling_factor=1.0, first_expert=0, num_local=E)


BAD = [
    ("x", dict(x=torch.randn(2, 4, H).bfloat16()), "x must be 2-D"),
    ("x", dict(x=torch.randn(4, H).half()), "x must have dtype bfloat16, float32; got float16"),
    ("x", dict(x=torch.randn(H, 4).bfloat16().t()), "x must be contiguous"),
    ("router_gemm", dict(router_gemm="tf32"), r"router_gemm must be one of \('fp32', 'bf16'\), got 'tf32'"),
    ("router_gemm", dict(x=torch.randn(4, H), w_down=torch.randn(L, H)), "router_gemm 'bf16' multiplies BF16 operands"),
    ("gate_weight", dict(gate_weight=torch.randn(E, H)), "gate_weight must have dtype bfloat16; got float32"),
    ("gate_weight", dict(gate_weight=torch.randn(E, H + 1).bfloat16()), r"gate_weight has shape \(40, 97\): expected \[E, H = 96\]"),
    ("w_down", dict(w_down=torch.randn(L, H)), "w_down must have dtype bfloat16; got float32"),
    ("w_down", dict(w_down=torch.randn(L, H - 8).bfloat16()), r"w_down has shape \(48, 88\): expected \[L, H = 96\]"),
    ("w_down", dict(w_down=torch.randn(H, L).bfloat16().t()), "w_down must be contiguous"),
    ("correction_bias", dict(correction_bias=torch.randn(E - 1)), "correction_bias has 39 entries but gate_weight has E = 40 rows"),
    ("top_k", dict(top_k=E + 1), r"top_k must be an int in \[1, E = 40\]"),
    ("num_local", dict(first_expert=30, num_local=11), r"num_local must be an int in \[1, E - first_expert = 10\]"),
]


@pytest.mark.parametrize("name, change, message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(name, change, message):
    assert_refused(OP, "route_and_project", _good() | change, message)


def test_side_by_side_switch(tuned):
    assert overlap_wanted(1) and overlap_wanted(OVERLAP_MAX_TOKENS) and not overlap_wanted(OVERLAP_MAX_TOKENS + 1)
    tuned(router_overlap_streams=False)
    assert not overlap_wanted(1)
    tuned(router_overlap_streams=True)
    assert overlap_wanted(4096)
    with pytest.raises(ValueError, match="router_overlap_streams='yes': expected True / 1"):
        tuned(router_overlap_streams="yes")


def test_launch_order_switch(tuned):
    assert overlap_order() == "router"
    tuned(router_overlap_order="down")
    assert overlap_order() == "down"
    with pytest.raises(ValueError, match="router_overlap_order='gate': expected one of router, down"):
        tuned(router_overlap_order="gate")
