"""Routed MXFP4 experts beyond decode on sm_90 under the prefill_regs override "choice" (the policy before the staged kernels,
kept to compare): the grouping picks the 64-row register-dequant blocks or the Triton tiles on the GPU by the local
experts' rows (pytest -m gpu). Against the float64 reference and the forced paths (bitwise:
the same kernels on the same blocks), every output written, and under CUDA-graph capture the pick follows the
replayed ids."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.expert_schedule import planned_grouping, run_experts
from latent_moe_fusion.ops.routed.producer_config import (
    PREFILL_CHOICE_MAX_ROWS,
    PREFILL_CHOICE_SETTING,
    PREFILL_REGS_BLOCK_M,
    PREFILL_REGS_MAX_ROWS,
)
from latent_moe_fusion.ops.routed.triton.moe_align_choice import GroupingChoice
from tests.expert_problems import make_problem, rel_l2, tolerance
from tests.float64_reference import routed64
from tests.regs_gpu import SM90_ONLY, SMALL, capture_routed, replay_on

pytestmark = SM90_ONLY

# 32 local experts, top-16: beyond the host-side bound from M = 8193 on (more than 4096 pairs per expert were every
# pair local), so the size here picks on the GPU: an EP share (~528 rows per hit expert) the regs blocks, every id
# local (4224 rows) the Triton tiles.
SIZES = SMALL
M = 8448  # 135168 pairs
REGS = str(PREFILL_REGS_BLOCK_M)  # the forced setting that runs the regs blocks the GPU picks
CHOICE = PREFILL_CHOICE_SETTING
assert M * SIZES["top_k"] > PREFILL_REGS_MAX_ROWS * SIZES["num_experts"]
assert M * SIZES["top_k"] // 8 < PREFILL_CHOICE_MAX_ROWS * SIZES["num_experts"] < M * SIZES["top_k"]


def _ep_share(m: int, ranks: int = 8) -> torch.Tensor:
    """ids of one EP rank: each token's experts among ranks x 32, the other ranks' ones -1 (~m / 16 rows per expert)."""
    experts = SIZES["num_experts"]
    ids = torch.stack([torch.randperm(ranks * experts)[:SIZES["top_k"]] for _ in range(m)]).to(torch.int32)
    return torch.where(ids < experts, ids, -1).cuda()


def _all_local(m: int) -> torch.Tensor:
    """ids with every token's experts on this rank: m x 16 / 32 rows per expert."""
    return torch.rand(m, SIZES["num_experts"], device="cuda").argsort(1)[:, :SIZES["top_k"]].to(torch.int32)


def _problem(routing: str):
    p = make_problem(M, weight_format="mxfp4", device="cuda", **SIZES)
    p.topk_ids.copy_(_ep_share(M) if routing == "ep_share" else _all_local(M))
    return p


def _run(p, tuned, setting: str) -> torch.Tensor:
    tuned(prefill_regs=setting)
    out = torch.full_like(p.z, float("nan"))
    return run_experts(*p.routed_args(), out=out)


@pytest.mark.parametrize("routing,picks_regs", [("ep_share", True), ("all_local", False)])
def test_the_gpu_picks_by_local_rows_and_matches_the_forced_path(routing, picks_regs, tuned, rng_seed):
    p = _problem(routing)
    tuned(prefill_regs=CHOICE)
    choice = planned_grouping(p.z, p.topk_ids, p.w13, p.w2, "mxfp4", p.w13_scale, p.w2_scale)
    assert isinstance(choice, GroupingChoice) and int(choice.picked_small.item()) == int(picks_regs)
    y = _run(p, tuned, CHOICE)
    assert torch.isfinite(y).all()  # every element written over the NaN poison
    assert rel_l2(y, routed64(*p.routed_args())) < tolerance(torch.bfloat16)
    forced = _run(p, tuned, REGS if picks_regs else "0")
    assert torch.equal(y, forced)  # the same kernels on the same blocks
    assert torch.equal(_run(p, tuned, CHOICE), y)  # bitwise repeatable


def test_a_given_grouping_choice_is_used(tuned, rng_seed):
    p = _problem("ep_share")
    tuned(prefill_regs=CHOICE)
    choice = planned_grouping(p.z, p.topk_ids, p.w13, p.w2, "mxfp4", p.w13_scale, p.w2_scale)
    y = run_experts(*p.routed_args(), grouping=choice)
    assert torch.equal(y, _run(p, tuned, CHOICE))
    plain = planned_grouping(p.z, p.topk_ids, p.w13, p.w2, "mxfp4")  # no scales: planned as plain Triton blocks
    with pytest.raises(ValueError, match="picks on the GPU .*scales included"):
        run_experts(*p.routed_args(), grouping=plain)


def test_the_pick_follows_the_replayed_ids_in_a_cuda_graph(tuned, rng_seed):
    p = _problem("ep_share")
    tuned(prefill_regs=CHOICE)
    graph, out = capture_routed(p)
    for routing, forced in (("all_local", "0"), ("ep_share", REGS)):  # captured on an EP share: both picks replay
        replay_on(graph, out, p, _problem(routing))
        assert torch.equal(out, _run(p, tuned, forced)), routing
        assert rel_l2(out, p.reference_routed()) < tolerance(torch.bfloat16)


def test_opcheck_where_the_gpu_picks(tuned, rng_seed):
    tuned(prefill_regs=CHOICE)
    p = _problem("ep_share")
    torch.library.opcheck(torch.ops.lmf.routed_experts.default, p.routed_args())
