"""The FP8 routed kernels (LMF_ROUTED_FP8 unset or 1: the L1 with the bf16 L2, the default; l1,l2: both; ops/routed/gluon/routed_fp8.py,
8-row blocks) on the GPU: the routed op against float64 and against the bf16 kernels, every output written (NaN poison), bitwise
repeatable, replayed in a CUDA graph on fresh routings; the split kernel bit for bit its torch form; and what the
path refuses, with errors that say so (pytest -m gpu; sm_90 only)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.expert_schedule import planned_grouping, run_experts
from latent_moe_fusion.ops.routed.fp8_split import split_e4m3
from latent_moe_fusion.ops.routed.gluon import FP8_K_MULTIPLE, launch_routed_l1_fp8
from latent_moe_fusion.ops.routed.producer_config import FP8_BLOCK_M, ROUTED_FP8_ENV
from latent_moe_fusion.ops.routed.schedule_rules import resolve_config
from latent_moe_fusion.ops.routed.triton.fp8_split_kernel import launch_split_e4m3
from tests.expert_problems import rel_l2, tolerance
from tests.float64_reference import routed64
from tests.regs_gpu import KIMI_RANK, SM90_ONLY, SMALL, assert_replays_fresh_routings, mxfp4_problem

pytestmark = SM90_ONLY

# Pairs per expert across one to five 8-row blocks, and experts with none (ids_with_rows; the rest other ranks').
EXPERT_ROWS = {32: (0, 1, 7, 8, 9, 15, 16, 3, 0, 2, 5, 12, 16, 11), 8: (1, 8, 9, 0, 12, 3, 5, 2)}
# FP8 against the bf16 kernels: both round act and the output to bf16 once; the FP8 route's products differ by
# ~3e-5 (docs/design/routed-dequantisation.md), so the outputs sit within ~1e-3 of each other.
FP8_VS_BF16 = 2e-3


def _run(p, monkeypatch, flag: str | None) -> torch.Tensor:
    """The routed op with LMF_ROUTED_FP8 = flag (None: unset, the default: the FP8 L1)."""
    if flag is None:
        monkeypatch.delenv(ROUTED_FP8_ENV, raising=False)
    else:
        monkeypatch.setenv(ROUTED_FP8_ENV, flag)
    out = torch.full_like(p.z, float("nan"))
    return run_experts(*p.routed_args(), out=out)


# Sizes where the grouping takes 16 rows (the FP8 path's domain): SMALL up to 24 tokens, KIMI_RANK 12.
CASES = [(SMALL, 8, "random"), (SMALL, 16, "rows"), (SMALL, 16, "few_experts"), (SMALL, 24, "one_expert"),
         (KIMI_RANK, 12, "random"), (KIMI_RANK, 12, "rows")]  # KIMI_RANK is top-8: 8 tokens take the GEMV


@pytest.mark.parametrize("flag, layers", [(None, (True, False)), ("1", (True, False)), ("l1,l2", (True, True))],
                         ids=["default", "1", "l1,l2"])
@pytest.mark.parametrize("sizes,m,routing", CASES,
                         ids=[f"{'kimi' if s is KIMI_RANK else 'small'}-m{m}-{r}" for s, m, r in CASES])
def test_fp8_route_matches_float64_and_the_bf16_kernels(sizes, m, routing, flag, layers, monkeypatch, rng_seed):
    if layers[1] and sizes["inter"] % FP8_K_MULTIPLE:
        pytest.skip(f"the FP8 L2 takes I in multiples of {FP8_K_MULTIPLE} (this problem: the bf16 L2, tested above)")
    p = mxfp4_problem(sizes, m, routing, EXPERT_ROWS)
    _run(p, monkeypatch, flag)  # sets the flag
    cfg = resolve_config(p.z, p.topk_ids.numel(), sizes["num_experts"], "mxfp4", sizes["inter"], None, None, p.w13, p.w2)
    assert cfg.routed_fp8 == layers and cfg.bm == FP8_BLOCK_M, cfg  # what run_experts takes
    y = _run(p, monkeypatch, flag)
    ref64 = routed64(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in p.routed_args()))
    assert rel_l2(y.cpu(), ref64) < tolerance(torch.bfloat16)
    assert rel_l2(y, _run(p, monkeypatch, "0")) < FP8_VS_BF16
    assert torch.equal(y, _run(p, monkeypatch, flag))  # bitwise repeatable, every element written


def test_fp8_route_replays_fresh_routings_in_a_cuda_graph(monkeypatch, rng_seed):
    p = mxfp4_problem(SMALL, 16, "random", EXPERT_ROWS)
    monkeypatch.setenv(ROUTED_FP8_ENV, "1")
    assert_replays_fresh_routings(p, lambda routing: mxfp4_problem(SMALL, 16, routing, EXPERT_ROWS),
                                  lambda: _run(p, monkeypatch, "1"))


def test_split_kernel_skips_the_rows_without_a_pair(rng_seed):
    z = torch.randn(6, 512, device="cuda").to(torch.bfloat16)
    live = torch.tensor([3, -1, 0, -1, 7, 2], dtype=torch.int32, device="cuda")
    hi, lo, factor = launch_split_e4m3(z, live)
    want = split_e4m3(z)
    rows = live >= 0
    for got, ref in zip((hi, lo, factor), want, strict=True):
        assert torch.equal(got[rows].view(torch.uint8), ref[rows].view(torch.uint8))
    with pytest.raises(ValueError, match="one entry per row"):
        launch_split_e4m3(z, live[:3])


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


def test_the_default_runs_the_bf16_kernels_where_the_fp8_ones_cannot(monkeypatch, rng_seed):
    """Unset, a call the FP8 kernels cannot take (non-contiguous gate/up weights) runs the bf16 kernels' path: the
    same output, bit for bit, as LMF_ROUTED_FP8=0; its planned grouping is theirs (16-row blocks)."""
    p = mxfp4_problem(SMALL, 8, "random", EXPERT_ROWS)
    wide = torch.zeros(*p.w13.shape[:-1], p.w13.shape[-1] * 2, dtype=p.w13.dtype, device="cuda")
    wide[..., : p.w13.shape[-1]] = p.w13
    p.w13 = wide[..., : p.w13.shape[-1]]
    y = _run(p, monkeypatch, None)
    assert torch.equal(y, _run(p, monkeypatch, "0"))
    monkeypatch.delenv(ROUTED_FP8_ENV)
    grouping = planned_grouping(p.z, p.topk_ids, p.w13, p.w2, "mxfp4", p.w13_scale, p.w2_scale)
    assert grouping.block_m == 16, grouping
    out = torch.full_like(p.z, float("nan"))
    assert torch.equal(run_experts(*p.routed_args(), out=out, grouping=grouping), y)


def test_fp8_switch_says_when_the_kernels_cannot_take_the_call(monkeypatch, rng_seed):
    p = mxfp4_problem(SMALL, 8, "random", EXPERT_ROWS)
    wide = torch.zeros(*p.w13.shape[:-1], p.w13.shape[-1] * 2, dtype=p.w13.dtype, device="cuda")
    wide[..., : p.w13.shape[-1]] = p.w13
    p.w13 = wide[..., : p.w13.shape[-1]]  # same values, not contiguous
    monkeypatch.setenv(ROUTED_FP8_ENV, "1")
    with pytest.raises(ValueError, match=f"{ROUTED_FP8_ENV}: the FP8 routed kernels cannot take this call"):
        run_experts(*p.routed_args())
