"""The routed launcher runs its plan and decides nothing: what launches, in which grids and where the shared expert
goes follow the plan's fields, also when a plan is changed by hand; a real call's plan agrees with the plan of its
shape (routed_plan.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latent_moe_fusion.ops.routed import expert_schedule, producer_config, routed_plan
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, launch_plan, run_experts
from latent_moe_fusion.ops.routed.routed_plan import plan_call, plan_routed
from tests.expert_problems import BETA, LIN_BETA, make_problem, rel_l2, tolerance

SIZES = dict(latent=64, inter=64, num_experts=4, top_k=2, hidden=64, inter_s=32)


class _Launches:
    """Records the launches of run_experts (name -> grid or arguments) instead of running them."""

    def __init__(self, monkeypatch):
        self.order: list[str] = []
        self.grids: dict[str, int] = {}
        for name in ("l1_kernel", "l2_kernel"):
            monkeypatch.setattr(expert_schedule, name, self._grid(name))
        for name in ("launch_routed_l1", "launch_routed_l2", "launch_routed_gemv", "launch_l1_finish",
                     "shared_by_library", "launch_combine"):
            monkeypatch.setattr(expert_schedule, name, self._call(name))
        real = expert_schedule.group_by_expert
        monkeypatch.setattr(expert_schedule, "group_by_expert", lambda *a: (self.order.append("grouping"), real(*a))[1])
        monkeypatch.setattr(expert_schedule, "_side_stream", lambda dev: None)

    def _grid(self, name):
        launches = self

        class Grid:
            def __getitem__(self, grid):
                launches.grids[name] = grid[0]
                return lambda *a, **k: launches.order.append(name)

        return Grid()

    def _call(self, name):
        return lambda *a, **k: self.order.append(name)


def _problem(tokens: int):
    return make_problem(tokens, weight_format="mxfp4", **SIZES)


def _shared(p) -> SharedExpert:
    return SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, torch.empty_like(p.x_s))


@pytest.fixture
def regs_allowed(monkeypatch):
    """As on an sm_90 GPU: the register-dequant kernels take these small shapes."""
    monkeypatch.setattr(routed_plan, "regs_reason", lambda *a: None)
    monkeypatch.setattr(routed_plan, "split_reason", lambda *a: None)


def _config(bm: int, **changes) -> producer_config.ProducerConfig:
    return replace(producer_config.pick_config(8, "mxfp4", torch.bfloat16, SIZES["num_experts"]), bm=bm, **changes)


@pytest.mark.parametrize("regs", [False, True])
def test_what_launches_is_what_the_plan_says(regs, regs_allowed, monkeypatch, rng_seed):
    p = _problem(3)
    shared = _shared(p)
    cfg = _config(16, routed_regs=regs)
    plan = plan_call(p.z, p.topk_ids, p.w13, p.w2, p.w13_scale, p.w2_scale, "mxfp4", p.x_s, p.w1_s, cfg)
    launches = _Launches(monkeypatch)
    run_experts(*p.routed_args(), shared=shared, config=cfg)
    assert plan.regs == regs and plan.family == ("regs" if regs else "triton")
    assert ("launch_routed_l1" in launches.order) == plan.regs == ("launch_routed_l2" in launches.order)
    shared_tiles = -(-3 // plan.grid_block_m) * -(-SIZES["inter_s"] // cfg.l1.shared_bn)
    routed_tiles = plan.triton_blocks * -(-SIZES["inter"] // cfg.l1.bn)
    assert launches.grids["l1_kernel"] == (shared_tiles * (plan.shared in ("side", "grid")) + routed_tiles) * \
        plan.triton_splits[0]
    assert (plan.triton_blocks == 0) == regs
    assert launches.order[-1] == "launch_combine"
    assert launches.order.index("grouping") < launches.order.index("l1_kernel") or not plan.group_first


def test_a_plan_changed_by_hand_is_followed(regs_allowed, monkeypatch, rng_seed):
    """The launcher reads the plan's placement of the shared expert, not the rules: a plan moved to in-line cuBLAS
    GEMMs first runs them first, though the rules would place 3 tokens' shared expert on the side stream."""
    p = _problem(3)
    cfg = _config(16, routed_regs=True)
    plan = plan_call(p.z, p.topk_ids, p.w13, p.w2, p.w13_scale, p.w2_scale, "mxfp4", p.x_s, p.w1_s, cfg)
    assert plan.shared == "side" and not plan.library_first
    launches = _Launches(monkeypatch)
    moved = replace(plan, shared="cublas", library_first=True)
    launch_plan(moved, p.z, p.topk_ids, p.topk_weights, p.w13, p.w2, p.w13_scale, p.w2_scale, BETA, LIN_BETA,
                shared=_shared(p))
    assert launches.order[0] == "shared_by_library" and launches.order.count("shared_by_library") == 1
    assert launches.grids.get("l1_kernel", 0) == 0  # no shared tiles in the grids, no routed tiles either
    launches.order.clear()
    after_l1 = replace(plan, shared="cublas", in_line_library=True)
    launch_plan(after_l1, p.z, p.topk_ids, p.topk_weights, p.w13, p.w2, p.w13_scale, p.w2_scale, BETA, LIN_BETA,
                shared=_shared(p))
    assert launches.order.index("launch_routed_l1") < launches.order.index("shared_by_library") < \
        launches.order.index("launch_routed_l2")


def test_a_run_follows_its_plan_and_matches_the_reference(rng_seed):
    """On the interpreter: the plan of the call (Triton tiles), run, against the float64-derived reference."""
    p = _problem(5)
    plan = plan_call(p.z, p.topk_ids, p.w13, p.w2, p.w13_scale, p.w2_scale, "mxfp4")
    assert plan.family == "triton" and plan.triton_blocks == plan.max_blocks > 0
    out = torch.full_like(p.z, float("nan"))
    y = launch_plan(plan, p.z, p.topk_ids, p.topk_weights, p.w13, p.w2, p.w13_scale, p.w2_scale, BETA, LIN_BETA,
                    out=out)
    assert torch.isfinite(y).all()
    assert rel_l2(y, p.reference_routed()) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 4, 8, 300, 4096])
def test_a_call_plans_as_its_shape(tokens, monkeypatch):
    """The plan of a call with the op's own layouts equals the plan of its shape (no CUDA device here)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    experts, latent, inter = 112, 512, 256
    z = torch.randn(tokens, latent).to(torch.bfloat16)
    ids = torch.randint(0, experts, (tokens, 16), dtype=torch.int32)
    w13 = torch.empty(experts, 2 * inter, latent // 2, dtype=torch.uint8)
    w2 = torch.empty(experts, latent, inter // 2, dtype=torch.uint8)
    s13 = torch.empty(experts, 2 * inter, latent // 32, dtype=torch.uint8)
    s2 = torch.empty(experts, latent, inter // 32, dtype=torch.uint8)
    of_call = plan_call(z, ids, w13, w2, s13, s2, "mxfp4")
    of_shape = plan_routed(tokens, 16, experts, latent, inter, capability=None, shared_rows=0)
    skip = {"decisions", "assumptions"}
    assert {k: v for k, v in vars(of_call).items() if k not in skip} == \
        {k: v for k, v in vars(of_shape).items() if k not in skip}
    assert [d.name for d in of_call.decisions] == [d.name for d in of_shape.decisions]


def test_memoised_plans_follow_the_overrides(tuned, monkeypatch):
    """A plan is memoised per call; an override the rules read changes it."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    first = plan_routed(300, 16, 112, 3584, 3072, capability=(9, 0))
    assert plan_routed(300, 16, 112, 3584, 3072, capability=(9, 0)) == first
    tuned(grid_shared="grid", regs_shared="side")
    moved = plan_routed(300, 16, 112, 3584, 3072, capability=(9, 0))
    assert moved.shared == "side" != first.shared
