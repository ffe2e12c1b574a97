"""The routed GEMV kernels on an sm_90+ GPU (pytest -m gpu): the Gluon kernel and the portable Triton kernel
against a float64 reference and the register-dequant MMA path, every valid row written (NaN poison),
bitwise repeatable, beside the shared expert, and replayed from a CUDA graph with fresh routings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latent_moe_fusion.ops.routed import routed_gemv
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from latent_moe_fusion.ops.routed.producer_config import pick_config
from latent_moe_fusion.ops.routed.triton.combine import launch_combine
from tests.expert_problems import EPS, bf16_vs_float64_tolerance, make_problem, make_routing, rel_l2, tolerance
from tests.float64_reference import rms_norm64, routed64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="the table-lookup GEMV needs sm_90+"),
]

KIMI_RANK = dict(latent=3584, inter=3072, num_experts=16, top_k=16, hidden=7168, inter_s=768)
SPECS = ["2x2x64w1p2r80", "8x4x64w1p1", "2x8x32w1p4", "4x2x64w2p2bf"]  # the default first


def _gemv(p, kernel: str, spec: str, tuned) -> torch.Tensor:
    """y (combine without norm) from launch_routed_gemv with the given kernel; act / pairs poisoned."""
    tuned(routed_gemv=spec)
    cfg = routed_gemv.routed_gemv_setting()[1]
    m, top_k = p.topk_ids.shape
    act = torch.full((m * top_k, p.w2.shape[-1] * 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    pairs = torch.full((m * top_k, p.z.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
    routed_gemv.launch_routed_gemv(p.z, p.topk_ids, p.w13, p.w13_scale, p.w2, p.w2_scale, act, pairs, 4.0, 25.0,
                                   cfg, False, kernel=kernel)
    valid = (p.topk_ids.reshape(-1) >= 0).nonzero().view(-1)
    assert not act[valid].isnan().any() and not pairs[valid].isnan().any(), "a valid pair's row was not written"
    y = torch.full_like(p.z, float("nan"))
    launch_combine(pairs, p.topk_ids, p.topk_weights, y, None, 0.0)
    return y


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("m,routing", [(1, "random"), (2, "random"), (4, "few_experts"), (1, "one_expert")])
def test_gluon_and_triton_match_float64_and_repeat_bitwise(m, routing, spec, tuned, rng_seed):
    p = make_problem(m, weight_format="mxfp4", routing=routing, device="cuda", **KIMI_RANK)
    ref = routed64(*p.routed_args())
    y = _gemv(p, "gluon", spec, tuned)
    assert rel_l2(y, ref) < tolerance(torch.bfloat16)
    assert torch.equal(y, _gemv(p, "gluon", spec, tuned))
    y_triton = _gemv(p, "triton", spec, tuned)
    assert rel_l2(y_triton, ref) < tolerance(torch.bfloat16)
    assert rel_l2(y, y_triton) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2])
def test_producer_on_the_gemv_path_matches_float64_and_the_mma_path(m, tuned, rng_seed):
    tuned(routed_gemv="1")
    p = make_problem(m, weight_format="mxfp4", routing="random", device="cuda", **KIMI_RANK)

    def producer(gemv: bool):
        cfg = replace(pick_config(m * KIMI_RANK["top_k"], "mxfp4", torch.bfloat16, KIMI_RANK["num_experts"]),
                      routed_gemv=gemv)
        y = torch.full_like(p.z, float("nan"))
        s_out = torch.full_like(p.x_s, float("nan"))
        run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=EPS,
                    shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out), config=cfg, out=y)
        return y, s_out

    y, s_out = producer(True)
    ref = rms_norm64(routed64(*p.routed_args()), p.rms_weight, EPS)
    assert rel_l2(y, ref) < bf16_vs_float64_tolerance()
    y_mma, s_mma = producer(False)
    assert rel_l2(y, y_mma) < tolerance(torch.bfloat16)
    assert torch.equal(s_out, s_mma)  # the shared expert is untouched by the routed path's choice


def test_picked_for_one_token_and_replayed_with_fresh_routings(tuned, rng_seed):
    tuned(routed_gemv=None)
    p = make_problem(1, weight_format="mxfp4", routing="random", device="cuda", **KIMI_RANK)
    assert pick_config(KIMI_RANK["top_k"], "mxfp4", torch.bfloat16, KIMI_RANK["num_experts"]).routed_gemv
    out = torch.empty_like(p.z)
    step = lambda: run_experts(*p.routed_args(), out=out)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for routing in ("random", "one_expert", "none", "random"):
        p.topk_ids.copy_(make_routing(1, KIMI_RANK["num_experts"], KIMI_RANK["top_k"], routing, "cuda"))
        p.z.copy_(torch.randn_like(p.z))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = routed64(*p.routed_args())
        if routing == "none":
            assert torch.equal(out.cpu(), torch.zeros_like(out.cpu()))
        else:
            assert rel_l2(out, ref) < tolerance(torch.bfloat16), routing
