"""The kernels of the 128-row prefill blocks (MXFP4 on sm_90; pytest -m gpu): the kappa kernels (routed_kappa.py, the
default), the staged kernels (routed_staged.py) and their warp-specialised form (routed_staged_ws.py), each picked by
the staged_kernel tuning override. Against the float64 reference and within FP32 rounding of the 64-row
register-dequant blocks (the sums group k otherwise, so not bit for bit), bitwise repeatable, every output written
over a NaN poison, blocks with up to 64 valid rows (the N = 64 MMA) and more, several blocks per expert, experts
without rows, under CUDA-graph capture, and opcheck; the warp-specialised kernels bit for bit the staged ones."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.expert_schedule import run_experts
from tests.expert_problems import rel_l2, tolerance
from tests.float64_reference import routed64
from tests.regs_gpu import KIMI_RANK, SM90_ONLY, SMALL, assert_replays_fresh_routings, mxfp4_problem

pytestmark = SM90_ONLY

# Rows per expert: one 128-row block at both edges of every MMA tier of the kappa kernels (N = 16, 32, 64, 64 + 16,
# 64 + 32, 128 by valid rows), two blocks (the second short), and experts with none.
EXPERT_ROWS = {32: (0, 5, 16, 17, 31, 32, 33, 40, 64, 65, 73, 80, 81, 96, 97, 100, 128, 129, 150, 200),
               8: (5, 17, 33, 64, 0, 80, 96, 150)}


def _problem(sizes: dict, m: int, routing: str):
    return mxfp4_problem(sizes, m, routing, EXPERT_ROWS)


def _run(p, tuned, rows: str) -> torch.Tensor:
    tuned(prefill_regs=rows)
    out = torch.full_like(p.z, float("nan"))
    return run_experts(*p.routed_args(), out=out)


KERNELS = ("kappa", "kappa_plain", "staged")
CASES = [(SMALL, 300, "rows"), (SMALL, 600, "random"), (SMALL, 600, "few_experts"), (SMALL, 600, "one_expert"),
         (KIMI_RANK, 220, "rows"), (KIMI_RANK, 200, "random")]


# FP32 sums of the same products in another grouping: after the BF16 roundings of act and y, a few elements one
# BF16 ulp apart (relative L2 ~1e-3 of an ulp-level difference on a handful of elements)
NEAR_64_ROWS = 2e-3


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("sizes,m,routing", CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{r}" for s, m, r in CASES])
def test_128_row_blocks_match_float64_and_64_row_blocks(sizes, m, routing, kernel, tuned, rng_seed):
    p = _problem(sizes, m, routing)
    tuned(staged_kernel=kernel)
    y = _run(p, tuned, "128")
    assert torch.isfinite(y).all()  # every element written over the NaN poison
    ref = routed64(*p.routed_args())
    assert rel_l2(y, ref) < tolerance(torch.bfloat16)
    y64 = _run(p, tuned, "64")
    assert rel_l2(y, y64) < NEAR_64_ROWS
    assert abs(rel_l2(y, ref) - rel_l2(y64, ref)) < 0.1 * rel_l2(y64, ref) + 1e-6  # as close to float64 as they
    assert torch.equal(y, _run(p, tuned, "128"))  # bitwise repeatable


@pytest.mark.parametrize("kernel", KERNELS + ("ws",))
def test_128_row_blocks_replay_fresh_ids_in_a_cuda_graph(kernel, tuned, rng_seed):
    tuned(prefill_regs="128", staged_kernel=kernel)
    p = _problem(SMALL, 600, "random")
    assert_replays_fresh_routings(p, lambda routing: _problem(SMALL, 600, routing), lambda: _run(p, tuned, "128"))


@pytest.mark.parametrize("kernel", KERNELS + ("ws",))
def test_opcheck_on_128_row_blocks(kernel, tuned, rng_seed):
    tuned(prefill_regs="128", staged_kernel=kernel)
    p = _problem(SMALL, 600, "random")
    torch.library.opcheck(torch.ops.lmf.routed_experts.default, p.routed_args())


# The warp-specialised persistent kernels (routed_staged_ws.py, the staged_kernel="ws" override): the same MMA
# sequence per tile as the staged kernels, so the same bits, over every case above and under graph replay.
@pytest.mark.parametrize("sizes,m,routing", CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{r}" for s, m, r in CASES])
def test_warp_specialised_kernels_equal_the_staged_ones(sizes, m, routing, tuned, rng_seed):
    p = _problem(sizes, m, routing)
    tuned(staged_kernel="staged")
    staged = _run(p, tuned, "128")
    tuned(staged_kernel="ws")
    y = _run(p, tuned, "128")
    assert torch.isfinite(y).all()  # every element written over the NaN poison
    assert rel_l2(y, routed64(*p.routed_args())) < tolerance(torch.bfloat16)
    assert torch.equal(y, staged)
    assert torch.equal(y, _run(p, tuned, "128"))  # bitwise repeatable

