"""The Gluon register-dequant routed kernels (MXFP4 decode on sm_90) on the GPU: against a float64
reference and the Triton kernels, every output written, bitwise repeatable, the shared expert on its
side stream unchanged, and under CUDA-graph capture (pytest -m gpu; skipped off sm_90)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from latent_moe_fusion.ops.routed.gluon import regs_path_reason
from latent_moe_fusion.ops.routed.producer_config import decode_block_m
from latent_moe_fusion.ops.routed.schedule_rules import shared_strategy
from tests.expert_problems import BETA, EPS, LIN_BETA, make_problem, rel_l2, tolerance
from tests.float64_reference import routed64
from tests.regs_gpu import KIMI_RANK, SM90_ONLY, SMALL

pytestmark = SM90_ONLY


def _run(p, shared: bool, tuned, regs: bool):
    tuned(mxfp4_regs=regs, routed_gemv=False)  # these few-token cases would otherwise take the routed GEMV
    y = torch.full_like(p.z, float("nan"))
    s_out = torch.full_like(p.x_s, float("nan"))
    sh = SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out) if shared else None
    run_experts(*p.routed_args(), rms_weight=p.rms_weight if shared else None, eps=EPS, shared=sh, out=y)
    torch.cuda.synchronize()
    return y, s_out


CASES = [(KIMI_RANK, 1), (KIMI_RANK, 8), (KIMI_RANK, 16), (SMALL, 1), (SMALL, 8), (SMALL, 32)]  # 16 and 32 rows


@pytest.mark.parametrize("sizes,m", CASES, ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}" for s, m in CASES])
@pytest.mark.parametrize("routing", ["random", "one_expert", "few_experts"])
def test_routed_matches_float64_and_triton(sizes, m, routing, tuned, rng_seed):
    p = make_problem(m, weight_format="mxfp4", routing=routing, device="cuda", **sizes)
    bm = decode_block_m(m * sizes["top_k"], sizes["num_experts"])
    assert bm in (16, 32)
    assert regs_path_reason(p.z, p.w13, p.w2, p.w13_scale, p.w2_scale, "mxfp4", bm) is None
    y, _ = _run(p, False, tuned, regs=True)
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y.cpu(), ref64) < tolerance(torch.bfloat16)
    y_triton, _ = _run(p, False, tuned, regs=False)
    assert rel_l2(y, y_triton) < tolerance(torch.bfloat16)
    y_again, _ = _run(p, False, tuned, regs=True)
    assert torch.equal(y, y_again)  # every element written (NaN poison), bitwise the same run to run


@pytest.mark.parametrize("m", [1, 8])
def test_shared_expert_on_the_side_stream(m, tuned, rng_seed):
    """The shared tiles on the Triton kernels alone on a side stream (the default up to 4 tokens, forced
    here): fragments as the unfused block rounds them, bitwise equal to the one-grid path where both use
    the same shared tiles (M = 8; at M = 1 the one-grid config splits K, which changes the FP32
    summation order), and the RMS-normalised routed output within bf16 tolerance of it."""
    from latent_moe_fusion.ops.common.reference_math import shared_expert_math

    tuned(regs_shared="side")
    p = make_problem(m, weight_format="mxfp4", device="cuda", **KIMI_RANK)
    y, s_out = _run(p, True, tuned, regs=True)
    y_triton, s_triton = _run(p, True, tuned, regs=False)
    assert rel_l2(s_out, shared_expert_math(p.x_s, p.w1_s, p.w3_s, p.w2_s, BETA, LIN_BETA)) < tolerance(torch.bfloat16)
    if m == 8:
        assert torch.equal(s_out, s_triton)
    assert rel_l2(y, y_triton) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("m", [8, 32])
def test_shared_expert_by_cublas_past_the_side_stream_tokens(m, tuned, rng_seed):
    """From 5 shared tokens on, the shared expert runs as cuBLAS GEMMs (on the side stream up to 16
    tokens, in line beyond): fragments within bf16 tolerance of the Triton grid's, and the routed output
    unchanged."""
    from latent_moe_fusion.ops.common.reference_math import shared_expert_math

    tuned(regs_shared=None)
    assert shared_strategy(m) == ("cublas_side" if m <= 16 else "cublas")
    p = make_problem(m, weight_format="mxfp4", device="cuda", **KIMI_RANK)
    y, s_out = _run(p, True, tuned, regs=True)
    y_triton, s_triton = _run(p, True, tuned, regs=False)
    assert rel_l2(s_out, s_triton) < tolerance(torch.bfloat16)
    ref = shared_expert_math(p.x_s, p.w1_s, p.w3_s, p.w2_s, BETA, LIN_BETA)  # the unfused block's roundings
    assert rel_l2(s_out, ref) < tolerance(torch.bfloat16)
    assert rel_l2(y, y_triton) < tolerance(torch.bfloat16)


def test_capture_and_replay_with_the_side_stream(tuned, rng_seed):
    tuned(mxfp4_regs=True, routed_gemv=False)  # captured on the register-dequant kernels, as _run replays them
    p = make_problem(8, weight_format="mxfp4", device="cuda", **KIMI_RANK)
    s_out = torch.empty_like(p.x_s)
    y = torch.empty_like(p.z)

    def step():
        run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=EPS,
                    shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out), out=y)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        fresh = make_problem(8, weight_format="mxfp4", device="cuda", **KIMI_RANK)
        p.z.copy_(fresh.z)
        p.x_s.copy_(fresh.x_s)
        p.topk_ids.copy_(fresh.topk_ids)
        p.topk_weights.copy_(fresh.topk_weights)
        graph.replay()
        torch.cuda.synchronize()
        y_eager, s_eager = _run(p, True, tuned, regs=True)
        assert torch.equal(y, y_eager) and torch.equal(s_out, s_eager)


SPLIT_CASES = [(KIMI_RANK, 1, (2, 2)), (KIMI_RANK, 1, (4, 4)), (KIMI_RANK, 1, (7, 3)), (KIMI_RANK, 2, (2, 1)),
               (SMALL, 32, (2, 2)), (SMALL, 32, (4, 1))]  # SMALL at 32 tokens: 32-row blocks


@pytest.mark.parametrize("sizes,m,split", SPLIT_CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{a}x{b}" for s, m, (a, b) in SPLIT_CASES])
def test_k_slices_match_float64_and_whole_k(sizes, m, split, tuned, rng_seed):
    """L1 / L2 cut along K (FP32 slice sums added in slice order): within bf16 tolerance of the float64
    reference and of the unsplit kernels, every element written, bitwise the same run to run."""
    from dataclasses import replace

    from latent_moe_fusion.ops.routed.producer_config import pick_config

    tuned(mxfp4_regs=True)
    p = make_problem(m, weight_format="mxfp4", routing="few_experts", device="cuda", **sizes)
    # these few tokens would take the routed GEMV (routed_gemv): keep them on the K-sliced MMA kernels
    base = replace(pick_config(m * sizes["top_k"], "mxfp4", torch.bfloat16, sizes["num_experts"]), routed_gemv=False)
    assert base.routed_regs

    def run(regs_split, producer=True):
        y = torch.full_like(p.z, float("nan"))
        s_out = torch.full_like(p.x_s, float("nan"))
        shared = SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out) if producer else None
        run_experts(*p.routed_args(), rms_weight=p.rms_weight if producer else None, eps=EPS, out=y,
                    shared=shared, config=replace(base, regs_split=regs_split))
        torch.cuda.synchronize()
        return y, s_out

    y, s_out = run(split)
    y_whole, s_whole = run((1, 1))
    assert rel_l2(y, y_whole) < tolerance(torch.bfloat16)
    assert torch.equal(s_out, s_whole)  # the shared expert is not split by regs_split
    y_plain, _ = run(split, producer=False)  # the routed op alone, against float64
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y_plain.cpu(), ref64) < tolerance(torch.bfloat16)
    y_again, _ = run(split)
    assert torch.equal(y, y_again)


def test_a_given_split_that_does_not_cut_k_says_why(tuned, rng_seed):
    from dataclasses import replace

    from latent_moe_fusion.ops.routed.producer_config import pick_config

    tuned(mxfp4_regs=True)
    p = make_problem(1, weight_format="mxfp4", device="cuda", **KIMI_RANK)
    # routed_gemv off: where the GEMV takes a call, the register-dequant kernels (and their split) are not used
    cfg = replace(pick_config(KIMI_RANK["top_k"], "mxfp4", torch.bfloat16, KIMI_RANK["num_experts"]), regs_split=(3, 1),
                  routed_gemv=False)
    with pytest.raises(ValueError, match="L1 K = 3584 does not cut into 3 slices"):
        run_experts(*p.routed_args(), config=cfg)


def test_a_picked_split_that_does_not_cut_k_runs_whole_k(monkeypatch, tuned, rng_seed):
    """L = 384 is 3 steps of 128: the picked single-token split (4 L1 slices) cannot cut it, so the
    Gluon kernels run whole K instead of the call falling back to the Triton kernels."""
    from latent_moe_fusion.ops.routed.gluon import routed_gemm
    from latent_moe_fusion.ops.routed.producer_config import REGS_DECODE_SPLIT

    assert 384 % (REGS_DECODE_SPLIT[0] * 128)
    splits = []
    real = routed_gemm.l1_regs_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                splits.append(kwargs["SPLIT"])
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(routed_gemm, "l1_regs_kernel", Spy())
    p = make_problem(1, weight_format="mxfp4", device="cuda", latent=384, inter=256, num_experts=8, top_k=8,
                     hidden=512, inter_s=128)
    y, _ = _run(p, False, tuned, regs=True)
    assert splits == [1]
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y.cpu(), ref64) < tolerance(torch.bfloat16)


def _routed_with(tuned, knob: str, value: str, p, cfg) -> torch.Tensor:
    """The routed op with the tuning override knob set to value, into a NaN-poisoned output."""
    tuned(**{knob: value})
    y = torch.full_like(p.z, float("nan"))
    run_experts(*p.routed_args(), out=y, config=cfg)
    torch.cuda.synchronize()
    return y


RING_CASES = [(KIMI_RANK, 8, (1, 1)), (KIMI_RANK, 16, (1, 1)), (KIMI_RANK, 2, (4, 2)), (KIMI_RANK, 2, (2, 3)),
              (SMALL, 8, (1, 1)), (SMALL, 32, (2, 2))]  # 28 / 7 / 14 and 24 / 12 / 8 steps; SMALL: 4 / 2 steps


@pytest.mark.parametrize("ring", ["cp2", "cp4", "tma", "tma,cp4"])
@pytest.mark.parametrize("sizes,m,split", RING_CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{a}x{b}" for s, m, (a, b) in RING_CASES])
def test_weight_rings_match_the_loads_bitwise(sizes, m, split, ring, tuned, rng_seed):
    """The weight words through a shared-memory ring (cp.async or TMA) instead of loads one step ahead:
    the same dequantised values into the same MMAs, so the same bits, every element written (NaN poison);
    K ranges that are no whole number of rounds of the ring (K slices of 7 and 14 steps) take the loads."""
    from dataclasses import replace

    from latent_moe_fusion.ops.routed.producer_config import pick_config

    tuned(mxfp4_regs=True)
    p = make_problem(m, weight_format="mxfp4", routing="random", device="cuda", **sizes)
    cfg = replace(pick_config(m * sizes["top_k"], "mxfp4", torch.bfloat16, sizes["num_experts"]), routed_gemv=False,
                  regs_split=split)

    def run(ring):
        return _routed_with(tuned, "mxfp4_ring", ring, p, cfg)

    y_loads, y_ring = run("loads"), run(ring)
    assert torch.equal(y_ring, y_loads)
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y_ring.cpu(), ref64) < tolerance(torch.bfloat16)


ORDER_CASES = [(KIMI_RANK, 8), (KIMI_RANK, 16), (SMALL, 32)]  # 16-row MMAs; 16- and 32-row; 32-row


@pytest.mark.parametrize("sizes,m", ORDER_CASES, ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}" for s, m in ORDER_CASES])
def test_tma_load_orders_give_the_same_bits(sizes, m, tuned, rng_seed):
    """The TMA ring's step issuing the next step's scales and activation tile before its stage wait or after
    its barrier (the mxfp4_load_order override) moves loads, not arithmetic: the same bits, every element written."""
    from dataclasses import replace

    from latent_moe_fusion.ops.routed.producer_config import pick_config

    tuned(mxfp4_regs=True, mxfp4_ring="tma")
    p = make_problem(m, weight_format="mxfp4", routing="random", device="cuda", **sizes)
    cfg = replace(pick_config(m * sizes["top_k"], "mxfp4", torch.bfloat16, sizes["num_experts"]), routed_gemv=False)

    def run(order):
        return _routed_with(tuned, "mxfp4_load_order", order, p, cfg)

    y_auto = run("auto")
    assert torch.equal(run("early"), y_auto) and torch.equal(run("late"), y_auto)
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y_auto.cpu(), ref64) < tolerance(torch.bfloat16)
