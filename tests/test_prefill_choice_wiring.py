"""How run_experts wires the choice on the GPU between the Triton tiles and the register-dequant kernels (CPU,
TRITON_INTERPRET=1): the Gluon kernels cannot run here, so host stand-ins with their contract take their place,
while the grouping and the Triton tiles run in the interpreter. Both picks must give the reference output, and
the unpicked family must find no used block. (The real kernels: tests/test_prefill_choice_gpu.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latent_moe_fusion.ops.common.reference_math import expert_weight, situ
from latent_moe_fusion.ops.routed import expert_schedule, routed_plan
from latent_moe_fusion.ops.routed.producer_config import pick_config
from tests.expert_problems import make_problem, rel_l2, tolerance

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the real kernels run in test_prefill_choice_gpu.py")

SIZES = dict(latent=64, inter=32, num_experts=8, top_k=4, hidden=64, inter_s=32)
M, SMALL_M, LARGE_M = 40, 16, 32


class RegsStandIn:
    """launch_routed_l1 / launch_routed_l2 on the host: the same buffers and contract, FP32 math, one rounding of
    the activation; records which blocks held an expert."""

    def __init__(self) -> None:
        self.used_blocks = 0

    def l1(self, z, w13, w13_scale, sorted_pairs, block_expert, act, num_blocks, block_m, top_k, beta, lin_beta,
           *args, **kwargs) -> None:
        assert len(block_expert) == num_blocks and block_m == SMALL_M
        for block, expert in enumerate(block_expert.tolist()):
            if expert < 0:
                continue
            self.used_blocks += 1
            w = expert_weight(w13, w13_scale, "mxfp4", expert)
            inter = w.shape[0] // 2
            for i, pair in enumerate(sorted_pairs[block * block_m:(block + 1) * block_m].tolist()):
                if pair >= 0:
                    h = w @ z[pair // top_k].float()
                    act[block * block_m + i] = situ(h[:inter], h[inter:], beta, lin_beta).to(act.dtype)

    def l2(self, act, w2, w2_scale, sorted_pairs, block_expert, pairs, num_blocks, block_m, *args, **kwargs) -> None:
        for block, expert in enumerate(block_expert.tolist()):
            if expert < 0:
                continue
            w = expert_weight(w2, w2_scale, "mxfp4", expert)
            for i, pair in enumerate(sorted_pairs[block * block_m:(block + 1) * block_m].tolist()):
                if pair >= 0:
                    pairs[pair] = w @ act[block * block_m + i].float()


@pytest.fixture
def stand_in(monkeypatch) -> RegsStandIn:
    regs = RegsStandIn()
    monkeypatch.setattr(routed_plan, "regs_reason", lambda *args: None)
    monkeypatch.setattr(expert_schedule, "launch_routed_l1", regs.l1)
    monkeypatch.setattr(expert_schedule, "launch_routed_l2", regs.l2)
    return regs


def _config():
    """The interpreter's tiles in LARGE_M-row blocks, with the choice of SMALL_M-row register-dequant blocks."""
    return replace(pick_config(M * SIZES["top_k"], "mxfp4", torch.bfloat16, SIZES["num_experts"]), bm=LARGE_M,
                   device_choice_bm=SMALL_M)


@pytest.mark.parametrize("max_rows,picks_regs", [(256, True), (2, False)])  # 2 rows: every expert holds more
def test_both_picks_give_the_reference(max_rows, picks_regs, stand_in, monkeypatch, rng_seed):
    monkeypatch.setattr(routed_plan, "PREFILL_CHOICE_MAX_ROWS", max_rows)
    p = make_problem(M, weight_format="mxfp4", **SIZES)
    out = torch.full_like(p.z, float("nan"))
    y = expert_schedule.run_experts(*p.routed_args(), config=_config(), out=out)
    assert (stand_in.used_blocks > 0) == picks_regs  # the unpicked stand-in found only unused blocks
    assert torch.isfinite(y).all()
    assert rel_l2(y, p.reference_routed()) < tolerance(torch.bfloat16)


def test_a_grouping_planned_for_other_blocks_is_refused(stand_in, rng_seed):
    p = make_problem(M, weight_format="mxfp4", **SIZES)
    plain = expert_schedule.group_by_expert(p.topk_ids, SIZES["num_experts"], LARGE_M)
    with pytest.raises(ValueError, match="picks on the GPU between 32-row Triton tiles and 16-row"):
        expert_schedule.run_experts(*p.routed_args(), config=_config(), grouping=plain)
