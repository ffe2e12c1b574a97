"""The opt-in FP8 routed L1 (LMF_ROUTED_FP8=1; gluon_kernels/routed_fp8.py, 8-row blocks shared with the bf16 L2) on
the GPU: the routed op against float64 and against the bf16 kernels, every output written (NaN poison), bitwise
repeatable, replayed in a CUDA graph on fresh routings; the split kernel bit for bit its torch form; and what the
path refuses, with errors that say so (pytest -m gpu; sm_90 only)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.fp8_split import split_e4m3
from latent_moe_fusion.ops.gluon_kernels import launch_routed_l1_fp8
from latent_moe_fusion.ops.triton_kernels.expert_schedule import run_experts
from latent_moe_fusion.ops.triton_kernels.fp8_split import launch_split_e4m3
from latent_moe_fusion.ops.triton_kernels.producer_config import FP8_BLOCK_M, ROUTED_FP8_ENV, pick_config
from tests.expert_problems import rel_l2, tolerance
from tests.float64_reference import routed64
from tests.regs_gpu import KIMI_RANK, SM90_ONLY, SMALL, assert_replays_fresh_routings, mxfp4_problem

pytestmark = SM90_ONLY

# Pairs per expert across one to five 8-row blocks, and experts with none (ids_with_rows; the rest other ranks').
EXPERT_ROWS = {32: (0, 1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 3, 0, 2, 5, 12), 8: (1, 8, 9, 0, 12, 3, 5, 2)}
# FP8 against the bf16 kernels: both round act and the output to bf16 once; the FP8 route's products differ by
# ~3e-5 (bench/results/fp8_split_numerics.md), so the outputs sit within ~1e-3 of each other.
FP8_VS_BF16 = 2e-3


def _run(p, monkeypatch, fp8: bool) -> torch.Tensor:
    monkeypatch.setenv(ROUTED_FP8_ENV, "1" if fp8 else "0")
    out = torch.full_like(p.z, float("nan"))
    return run_experts(*p.routed_args(), out=out)


CASES = [(SMALL, 8, "random"), (SMALL, 32, "rows"), (SMALL, 32, "few_experts"), (SMALL, 32, "one_expert"),
         (KIMI_RANK, 12, "random"), (KIMI_RANK, 12, "rows")]  # KIMI_RANK is top-8: 8 tokens take the GEMV


@pytest.mark.parametrize("sizes,m,routing", CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{r}" for s, m, r in CASES])
def test_fp8_route_matches_float64_and_the_bf16_kernels(sizes, m, routing, monkeypatch, rng_seed):
    p = mxfp4_problem(sizes, m, routing, EXPERT_ROWS)
    monkeypatch.setenv(ROUTED_FP8_ENV, "1")
    cfg = pick_config(p.topk_ids.numel(), "mxfp4", torch.bfloat16, sizes["num_experts"])
    assert cfg.routed_fp8 and cfg.bm == FP8_BLOCK_M, cfg
    y = _run(p, monkeypatch, True)
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y.cpu(), ref64) < tolerance(torch.bfloat16)
    assert rel_l2(y, _run(p, monkeypatch, False)) < FP8_VS_BF16
    assert torch.equal(y, _run(p, monkeypatch, True))  # bitwise repeatable, every element written


def test_fp8_route_replays_fresh_routings_in_a_cuda_graph(monkeypatch, rng_seed):
    p = mxfp4_problem(SMALL, 32, "random", EXPERT_ROWS)
    monkeypatch.setenv(ROUTED_FP8_ENV, "1")
    assert_replays_fresh_routings(p, lambda routing: mxfp4_problem(SMALL, 32, routing, EXPERT_ROWS),
                                  lambda: _run(p, monkeypatch, True))


@pytest.mark.parametrize("tokens, k", [(1, 512), (7, 3584), (300, 3584)])
def test_split_kernel_is_its_torch_form_bit_for_bit(tokens, k, rng_seed):
    z = torch.randn(tokens, k, device="cuda")
    z *= torch.logspace(-30, 30, tokens, device="cuda")[:, None]
    z[0, 3] = 448.0  # a row's largest value right at e4m3's top
    if tokens > 2:
        z[1] = 0.0
        z[2, :] = torch.finfo(torch.bfloat16).tiny / 4  # bf16 subnormals
    z = z.to(torch.bfloat16)
    for got, want in zip(launch_split_e4m3(z), split_e4m3(z), strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_fp8_l1_refuses_blocks_it_has_no_path_for():
    p = mxfp4_problem(SMALL, 8, "random", EXPERT_ROWS)
    hi, lo, factor = launch_split_e4m3(p.z)
    act = torch.empty(64, p.w2.shape[-1] * 2, dtype=torch.bfloat16, device="cuda")
    ids = torch.zeros(64, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="blocks of"):
        launch_routed_l1_fp8(hi, lo, factor, p.w13, p.w13_scale, ids, ids[:1], act, 1, 64, 16, 4.0, 25.0)


def test_fp8_switch_says_when_the_kernels_cannot_take_the_call(monkeypatch, rng_seed):
    p = mxfp4_problem(SMALL, 8, "random", EXPERT_ROWS)
    wide = torch.zeros(*p.w13.shape[:-1], p.w13.shape[-1] * 2, dtype=p.w13.dtype, device="cuda")
    wide[..., : p.w13.shape[-1]] = p.w13
    p.w13 = wide[..., : p.w13.shape[-1]]  # same values, not contiguous
    monkeypatch.setenv(ROUTED_FP8_ENV, "1")
    with pytest.raises(ValueError, match=f"{ROUTED_FP8_ENV}=1: the FP8 routed kernels cannot take this call"):
        run_experts(*p.routed_args())
