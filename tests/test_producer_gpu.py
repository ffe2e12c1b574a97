"""Triton routed experts / producer on a CUDA GPU against the reference ops (pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common.backends import select_backend
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from latent_moe_fusion.ops.routed.producer_config import (
    GemmTiles,
    ProducerConfig,
    pick_config,
)
from latent_moe_fusion.ops.routed.triton.weight_tiles import (
    DEQUANT_ASM,
    DEQUANT_ASM_PAIRS,
    DEQUANT_DOT_SCALED,
    DEQUANT_LUT,
    DEQUANT_TRITON,
)
from tests.expert_problems import make_problem, rel_l2, tolerance

pytestmark = pytest.mark.gpu

MID = dict(latent=512, inter=256, num_experts=32, top_k=16, hidden=1024, inter_s=128)
KIMI_RANK = dict(latent=3584, inter=3072, num_experts=8, top_k=8, hidden=7168, inter_s=768)


def _poisoned_run(p, config=None, shared=True):
    y_out = torch.full_like(p.z, float("nan"))
    s_out = torch.full_like(p.x_s, float("nan"))
    sh = SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out) if shared else None
    y = run_experts(*p.routed_args(), rms_weight=p.rms_weight if shared else None, eps=1e-5, shared=sh,
                    config=config, out=y_out)
    return y, s_out


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("routing", ["random", "one_expert", "few_experts", "none"])
# MXFP4 on Hopper: 300 * 16 pairs (150 per expert were every pair local) and 600 * 16 the register-dequant kernels'
# 64-row blocks by default, their 32-row blocks with prefill_regs=32, the Triton prefill tiles (BM = 128) with
# prefill_regs=0 (tuning overrides); 600: the spread grouping
@pytest.mark.parametrize("m, prefill_regs", [(1, None), (13, None), (300, None), (600, None), (300, 0), (600, 0),
                                             (600, 32)])
def test_routed_op_matches_reference(weight_format, routing, m, prefill_regs, tuned, rng_seed):
    tuned(prefill_regs=prefill_regs)
    p = make_problem(m, weight_format=weight_format, routing=routing, device="cuda", **MID)
    assert select_backend("routed_experts", "cuda", *p.routed_args()).name == "triton"
    y = torch.ops.lmf.routed_experts(*p.routed_args())
    ref = p.reference_routed()
    if routing == "none":
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert rel_l2(y, ref) < tolerance(torch.bfloat16)
    y_poisoned, _ = _poisoned_run(p, shared=False)
    assert torch.equal(y_poisoned, y)  # every element written, and bitwise the same run to run


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("mode", ["local", "token_publish", "hidden_scatter"])
@pytest.mark.parametrize("m", [8, 77])
def test_producer_op_matches_reference(weight_format, mode, m, rng_seed):
    p = make_problem(m, weight_format=weight_format, device="cuda", **MID)
    y_n, ws = torch.ops.lmf.moe_shared_producer(*p.producer_args(mode))
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y_n, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(ws.reshape(m, -1), ref_s) < tolerance(torch.bfloat16)
    y_p, s_p = _poisoned_run(p)
    assert torch.equal(y_p, y_n) and torch.equal(s_p, ws.reshape(m, -1))


def test_producer_float32_is_tight(rng_seed):
    p = make_problem(19, dtype=torch.float32, device="cuda", **MID)
    y_n, ws = torch.ops.lmf.moe_shared_producer(*p.producer_args())
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y_n, ref_y) < tolerance(torch.float32)
    assert rel_l2(ws[0], ref_s) < tolerance(torch.float32)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_kimi_rank_sizes(weight_format, rng_seed):
    p = make_problem(24, weight_format=weight_format, device="cuda", **KIMI_RANK)
    y, s = _poisoned_run(p)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(s, ref_s) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("dequant", [DEQUANT_TRITON, DEQUANT_ASM, DEQUANT_ASM_PAIRS, DEQUANT_DOT_SCALED, DEQUANT_LUT])
def test_mxfp4_dequant_variants(dequant, rng_seed):
    m = 5
    p = make_problem(m, weight_format="mxfp4", device="cuda", **MID)
    base = pick_config(m * MID["top_k"], "mxfp4", torch.bfloat16)
    cfg = ProducerConfig(base.bm, base.l1, base.l2, dequant)
    y, s = _poisoned_run(p, config=cfg)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(s, ref_s) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_other_tile_shapes(weight_format, rng_seed):
    p = make_problem(40, weight_format=weight_format, device="cuda", **MID)
    ref_y, ref_s = p.reference_producer()
    for cfg in (ProducerConfig(64, GemmTiles(128, 64, 4, 3), GemmTiles(256, 64, 8, 3)),
                ProducerConfig(16, GemmTiles(64, 256, 4, 3, 32, 128), GemmTiles(64, 128, 4, 4, 32, 128))):
        y, s = _poisoned_run(p, config=cfg)
        assert rel_l2(y, ref_y) < tolerance(torch.bfloat16) and rel_l2(s, ref_s) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_cuda_graph_capture_and_replay(weight_format, rng_seed):
    p = make_problem(12, weight_format=weight_format, device="cuda", **MID)
    args = p.producer_args()
    torch.ops.lmf.moe_shared_producer(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_n, ws = torch.ops.lmf.moe_shared_producer(*args)
    # New inputs in the same buffers: the replay must follow them (no routing baked in at capture).
    fresh = make_problem(12, weight_format=weight_format, device="cuda", **MID)
    for name in ("z", "topk_ids", "topk_weights", "x_s"):
        getattr(p, name).copy_(getattr(fresh, name))
    graph.replay()
    torch.cuda.synchronize()
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y_n, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(ws[0], ref_s) < tolerance(torch.bfloat16)
    eager_y, eager_ws = torch.ops.lmf.moe_shared_producer(*args)
    assert torch.equal(eager_y, y_n) and torch.equal(eager_ws, ws)


def test_opcheck_on_cuda(rng_seed):
    p = make_problem(6, device="cuda", **MID)
    torch.library.opcheck(torch.ops.lmf.routed_experts.default, p.routed_args())
    torch.library.opcheck(torch.ops.lmf.moe_shared_producer.default, p.producer_args())


@pytest.mark.parametrize("dequant", [DEQUANT_ASM_PAIRS, DEQUANT_LUT])
@pytest.mark.parametrize("sizes", [MID, KIMI_RANK], ids=["mid", "kimi_rank"])
def test_mxfp4_weight_tiles_through_tensor_descriptors(dequant, sizes, rng_seed):
    from dataclasses import replace

    m = 9
    p = make_problem(m, weight_format="mxfp4", device="cuda", **sizes)
    base = pick_config(m * sizes["top_k"], "mxfp4", torch.bfloat16)
    cfg = replace(base, l1=replace(base.l1, tma=True), l2=replace(base.l2, tma=True), dequant=dequant)
    y, s = _poisoned_run(p, config=cfg)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(s, ref_s) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
@pytest.mark.parametrize("splits", [(2, 2), (4, 3)])
@pytest.mark.parametrize("m", [1, 9])
def test_split_k_at_kimi_rank_sizes(weight_format, splits, m, rng_seed):
    from dataclasses import replace

    p = make_problem(m, weight_format=weight_format, device="cuda", **KIMI_RANK)
    base = pick_config(m * KIMI_RANK["top_k"], weight_format, torch.bfloat16)
    cfg = replace(base, l1=replace(base.l1, split_k=splits[0]), l2=replace(base.l2, split_k=splits[1]))
    y, s = _poisoned_run(p, config=cfg)
    y2, s2 = _poisoned_run(p, config=cfg)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(s, ref_s) < tolerance(torch.bfloat16)
    assert torch.equal(y, y2) and torch.equal(s, s2)


def test_id_check_stalls_nothing_before_the_launches_and_lmf_check_ids_0_skips_it(monkeypatch, rng_seed):
    """Outside CUDA graphs the id range check of the Triton backends copies the largest id to pinned memory
    and waits for it only after the op's last launch: no stream sync before the kernels, and the result
    unchanged. LMF_CHECK_IDS=0 skips the check altogether."""
    from latent_moe_fusion.ops.routed import expert_ids_check, expert_schedule

    p = make_problem(5, device="cuda", **MID)
    torch.ops.lmf.routed_experts(*p.routed_args())  # compile outside the checks below
    torch.cuda.synchronize()
    events = []
    combine, finish = expert_schedule.launch_combine, expert_ids_check.DeferredIdCheck.finish
    monkeypatch.setattr(expert_schedule, "launch_combine", lambda *a, **k: (events.append("combine"), combine(*a, **k)))
    monkeypatch.setattr(expert_ids_check.DeferredIdCheck, "finish", lambda self: (events.append("finish"), finish(self)))
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = torch.ops.lmf.routed_experts(*p.routed_args())
        _, ws = torch.ops.lmf.moe_shared_producer(*p.producer_args())
        assert events == ["combine", "finish", "combine", "finish"]
        monkeypatch.setenv("LMF_CHECK_IDS", "0")
        y_unchecked = torch.ops.lmf.routed_experts(*p.routed_args())
        assert events[4:] == ["combine"]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_l2(y, p.reference_routed()) < tolerance(torch.bfloat16)
    assert torch.equal(y, y_unchecked)


@pytest.mark.parametrize("op", ["routed_experts", "moe_shared_producer"])
def test_out_of_range_ids_on_cuda_raise_after_the_deferred_check(op, rng_seed):
    """Ids >= E on the GPU: the Triton kernels skip them (no out-of-bounds access) and the op raises the
    same clear error as the synchronous check."""
    from latent_moe_fusion.ops import LmfInputError

    p = make_problem(5, device="cuda", **MID)
    num_experts = MID["num_experts"]
    p.topk_ids[2, 3] = num_experts
    args = p.routed_args() if op == "routed_experts" else p.producer_args()
    with pytest.raises(LmfInputError, match=f"topk_ids holds expert id {num_experts} but w13 has only {num_experts}"):
        getattr(torch.ops.lmf, op)(*args)
    torch.cuda.synchronize()  # and the kernels that ran on the bad ids left the device usable


@pytest.mark.parametrize("routing", ["random", "few_experts"])
def test_in_line_shared_gemms_first_or_after_l1_give_the_same_bits(routing, tuned, rng_seed):
    """At prefill sizes the producer launches its library shared GEMMs before the routed grouping (the default) or
    after the routed L1: the same kernels on one stream, so the same bits; both within tolerance of the reference."""
    from latent_moe_fusion.ops.routed.schedule_rules import in_line_library_first

    p = make_problem(300, weight_format="mxfp4", routing=routing, device="cuda", **KIMI_RANK)
    outs = {}
    for order in ("first", "after_l1"):
        tuned(shared_in_line=order)
        outs[order] = torch.ops.lmf.moe_shared_producer(*p.producer_args())
    tuned(shared_in_line=None)
    assert in_line_library_first(300)
    assert all(torch.equal(a, b) for a, b in zip(outs["first"], outs["after_l1"], strict=True))
    y_ref, s_ref = p.reference_producer()
    assert rel_l2(outs["first"][0], y_ref) < tolerance(torch.bfloat16)
    assert rel_l2(outs["first"][1].view_as(s_ref), s_ref) < tolerance(torch.bfloat16)
