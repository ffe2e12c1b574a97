"""The register-dequant kernels in 64-row blocks (MXFP4 beyond decode on sm_90; pytest -m gpu): against the float64
reference, bitwise equal to 32-row blocks (the same FP32 sums per output element: only the MMA's N changes), every
output written, the same bits on every weight ring, blocks with 16 / 32 / 64 valid rows all taken, and under
CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.expert_schedule import run_experts
from latent_moe_fusion.ops.routed.gluon import WEIGHT_RINGS
from latent_moe_fusion.ops.routed.producer_config import PREFILL_REGS_BLOCK_M, pick_config
from tests.expert_problems import rel_l2, tolerance
from tests.float64_reference import routed64
from tests.regs_gpu import KIMI_RANK, SM90_ONLY, SMALL, assert_replays_fresh_routings, mxfp4_problem

pytestmark = SM90_ONLY

# Rows per expert chosen so that the 64-row blocks hold every count of valid rows the kernels tell apart: <= 16
# (N = 16 MMA), 17 .. 32 (N = 32), 33 .. 64 (N = 64), across one to three blocks per expert, and experts with none.
EXPERT_ROWS = {32: (0, 5, 16, 17, 31, 32, 33, 40, 64, 65, 70, 96, 100, 128, 130, 150),
               8: (5, 17, 33, 64, 0, 70, 100, 130)}  # by the problem's number of experts


def _run(p, tuned, rows: str, ring: str = "") -> torch.Tensor:
    tuned(prefill_regs=rows or None, mxfp4_ring=ring or None)  # "": the measured default
    out = torch.full_like(p.z, float("nan"))
    return run_experts(*p.routed_args(), out=out)


def _problem(sizes: dict, m: int, routing: str):
    return mxfp4_problem(sizes, m, routing, EXPERT_ROWS)


# All of them beyond PREFILL_REGS_FEW_ROWS pairs per expert were every pair local (the 64-row blocks' sizes):
# SMALL from 257 tokens on (decode sizes up to 256), KIMI_RANK (8 experts, top-8) from 129.
CASES = [(SMALL, 300, "rows"), (SMALL, 600, "random"), (SMALL, 600, "few_experts"), (SMALL, 600, "one_expert"),
         (KIMI_RANK, 160, "rows"), (KIMI_RANK, 200, "random")]


@pytest.mark.parametrize("sizes,m,routing", CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{r}" for s, m, r in CASES])
def test_64_row_blocks_match_float64_and_32_row_blocks_bitwise(sizes, m, routing, tuned, rng_seed):
    p = _problem(sizes, m, routing)
    tuned(prefill_regs=None)
    cfg = pick_config(p.topk_ids.numel(), "mxfp4", torch.bfloat16, sizes["num_experts"])
    assert cfg.routed_regs and cfg.bm == PREFILL_REGS_BLOCK_M == 64  # the default beyond the decode blocks
    y = _run(p, tuned, "")
    assert torch.isfinite(y).all()  # every element written over the NaN poison
    assert rel_l2(y, routed64(*p.routed_args())) < tolerance(torch.bfloat16)
    assert torch.equal(y, _run(p, tuned, "64"))
    assert torch.equal(y, _run(p, tuned, "32"))  # same sums per element, only the MMA's N differs
    assert torch.equal(y, _run(p, tuned, ""))  # bitwise repeatable


@pytest.mark.parametrize("ring", list(WEIGHT_RINGS))
def test_64_row_blocks_give_the_same_bits_on_every_weight_ring(ring, tuned, rng_seed):
    p = _problem(KIMI_RANK, 160, "rows")
    assert torch.equal(_run(p, tuned, "64", ring), _run(p, tuned, "64"))


def test_64_row_blocks_replay_fresh_ids_in_a_cuda_graph(tuned, rng_seed):
    p = _problem(SMALL, 600, "random")
    tuned(prefill_regs=None)
    assert_replays_fresh_routings(p, lambda routing: _problem(SMALL, 600, routing), lambda: _run(p, tuned, ""))


def test_opcheck_on_64_row_blocks(tuned, rng_seed):
    tuned(prefill_regs=None)
    p = _problem(SMALL, 600, "random")
    torch.library.opcheck(torch.ops.lmf.routed_experts.default, p.routed_args())
