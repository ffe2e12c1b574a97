"""Which routed-expert kernels run for a shape, and why: one answer from sizes and a device capability alone.

plan_routed walks run_experts' decisions (expert_schedule.py) by calling the functions that make them (pick_config,
fit_picked, regs_shape_reason, routed_gemv_shape_reason, split_reason, weight_rings, ring_for, max_registers,
shared_strategy, ...), so the plan cannot disagree with what runs. What those functions cannot see without tensors
is assumed at its best (contiguous, 16-byte aligned weights and scales in the op's layouts; bf16 pairs readable from
the activations) and listed in RoutedPlan.assumptions. The switches they read (TRITON_INTERPRET, LMF_ROUTED_FP8,
the tuning overrides) are read here too: the plan answers for this process's environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from latent_moe_fusion import tuning

from ..common.plan_lines import Decision, plan_lines
from .expert_schedule import (
    _without_fp8,
    fit_picked,
    grid_shared_strategy,
    grouping_goes_first,
    in_line_library_first,
    shared_strategy,
)
from .gluon import STAGED_BLOCK_ROWS, STEP_K, WEIGHT_RINGS, max_registers, regs_shape_reason, ring_for, split_reason
from .gluon import weight_rings as regs_weight_rings
from .producer_config import (
    DECODE_PAIRS,
    ProducerConfig,
    interpreting,
    pick_config,
    routed_fp8_forced,
    rows_per_expert,
)
from .routed_gemv import routed_gemv_setting, routed_gemv_shape_reason

# What the plan cannot see without the tensors; each is true of the op's own weights (ops/routed/producer_op.py).
ASSUMPTIONS = (
    "weights and scales contiguous, 16-byte aligned, scale shapes matching (else: Triton tiles, no TMA tiles)",
    "activations with unit column stride and even row stride / offset (else: no routed GEMV)",
    "shared-expert K tiles fitted to the routed K only (the shared expert's H and I_s may shrink them)",
)


@dataclass(frozen=True)
class RoutedPlan:
    num_tokens: int
    num_pairs: int
    capability: tuple[int, int] | None  # None: no CUDA device (the Triton interpreter or the reference)
    family: str  # "gemv" | "regs" | "regs_fp8" | "staged" | "triton_or_regs" (GPU choice) | "triton" | "none"
    block_m: int  # rows per grouping block (0: no grouping)
    choice_block_m: int  # > 0: the GPU picks between block_m-row Triton tiles and these register-dequant blocks
    fp8_layers: tuple[bool, bool]
    k_splits: tuple[int, int]  # K slices (L1, L2) of the routed kernels that run
    rings: tuple[str, str] | None  # weight rings (L1, L2) of the register-dequant / FP8 / staged kernels
    max_registers: tuple[int | None, int | None] | None
    shared: str  # where the shared expert runs ("none" without one)
    group_first: bool
    config: ProducerConfig  # the config run_experts launches with (K tiles fitted, fallbacks applied)
    decisions: tuple[Decision, ...]  # one line per choice, with its reason
    assumptions: tuple[str, ...] = ASSUMPTIONS

    def lines(self) -> list[str]:
        return plan_lines(self.decisions, self.assumptions)


def _ideal_layouts(latent: int, inter: int, weight_format: str) -> tuple[tuple, tuple]:
    """expert_schedule._layout of contiguous, aligned w13 [E, 2I, L] and w2 [E, L, I] (MXFP4: two values a byte)."""
    if weight_format == "mxfp4":
        return (True, latent // 2, 0, 1), (True, inter // 2, 0, 1)
    return (True, latent * 2, 0, 2), (True, inter * 2, 0, 2)


def plan_routed(
    num_tokens: int, top_k: int, num_local_experts: int, latent: int, inter: int, weight_format: str = "mxfp4",
    dtype: torch.dtype = torch.bfloat16, capability: tuple[int, int] | None = (9, 0), shared_rows: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RoutedPlan:
    """What run_experts picks for num_tokens tokens of top_k slots over num_local_experts experts of latent size L
    and intermediate size I on a device of this capability; shared_rows: the shared expert's rows in the same call
    (None: num_tokens, the producer's case; 0: none); overrides: tuning overrides in force (tuning.overrides)."""
    with tuning.overrides(**dict(overrides or {})):
        return _plan(num_tokens, top_k, num_local_experts, latent, inter, weight_format, dtype, capability,
                     num_tokens if shared_rows is None else shared_rows)


def _plan(
    num_tokens: int, top_k: int, experts: int, latent: int, inter: int, weight_format: str, dtype: torch.dtype,
    capability: tuple[int, int] | None, m_s: int,
) -> RoutedPlan:
    num_pairs = num_tokens * top_k
    mxfp4 = weight_format == "mxfp4"
    on_cuda = capability is not None
    decisions: list[Decision] = []

    def decide(name: str, value: Any, reason: str) -> None:
        decisions.append(Decision(name, str(value), reason))

    picked = pick_config(num_pairs, weight_format, dtype, experts, capability=capability)
    cfg = fit_picked(picked.with_k_dims((latent, inter), None, mxfp4), num_pairs, experts, (latent, inter), mxfp4,
                     *_ideal_layouts(latent, inter, weight_format))
    per_expert = rows_per_expert(num_pairs, experts)
    where = "interpreter tiles (TRITON_INTERPRET)" if interpreting() else \
        f"decode (<= {DECODE_PAIRS} pairs)" if num_pairs <= DECODE_PAIRS else "prefill"
    decide("pairs", num_pairs, f"{num_tokens} tokens x top-{top_k}; {per_expert:.1f} per local expert were all local; "
                               f"{where}")

    # expert_schedule.fp8_fallback: the default FP8 path drops to bf16 where its kernels cannot take the call.
    fp8_checked = False
    fp8_why = None
    if any(cfg.routed_fp8) and not routed_fp8_forced():
        fp8_why = regs_shape_reason(latent, inter, dtype, weight_format, cfg.bm, cfg.routed_fp8, capability)
        if fp8_why is None:
            fp8_checked = True
        else:
            cfg = _without_fp8(cfg, num_pairs, experts)

    gemv_why = "not picked: more than the GEMV's pairs, or not MXFP4 on sm_90"
    gemv = cfg.routed_gemv and num_pairs > 0
    if gemv:
        gemv_why = routed_gemv_shape_reason(latent, inter, weight_format, num_pairs, routed_gemv_setting()[1], dtype,
                                            on_cuda)
        gemv = gemv_why is None
    regs_why = "not picked: " + ("the routed GEMV takes the call" if gemv else "pick_config keeps the Triton tiles")
    regs = cfg.routed_regs and num_pairs > 0 and not gemv
    split_why = None
    if regs:
        regs_why = None if fp8_checked else \
            regs_shape_reason(latent, inter, dtype, weight_format, cfg.bm, cfg.routed_fp8, capability)
        split_why = split_reason(cfg.regs_split, latent, inter) if regs_why is None else None
        if split_why is not None:
            cfg = replace(cfg, regs_split=(1, 1))
        if regs_why is not None and any(cfg.routed_fp8):
            raise ValueError(f"LMF_ROUTED_FP8: the FP8 routed kernels cannot take this call ({regs_why})")
        regs = regs_why is None
    choice_bm, choice_why = 0, None
    if not (regs or gemv) and cfg.device_choice_bm and num_pairs and not (cfg.routed_regs or cfg.routed_gemv):
        choice_why = regs_shape_reason(latent, inter, dtype, weight_format, cfg.device_choice_bm, (False, False),
                                       capability)
        choice_bm = cfg.device_choice_bm if choice_why is None else 0

    bm = cfg.bm
    fp8 = cfg.routed_fp8 if regs else (False, False)
    if num_pairs == 0:
        family, why = "none", "no (token, slot) pairs"
    elif gemv:
        family, why = "gemv", f"CUDA-core GEMV per (token, slot) pair: {num_pairs} pairs, no grouping"
    elif regs and bm == STAGED_BLOCK_ROWS:
        family, why = "staged", "Gluon staged kernels: weights dequantised once per 128-row block into shared memory"
    elif regs and any(fp8):
        family, why = "regs_fp8", f"Gluon register-dequant on FP8 MMAs (LMF_ROUTED_FP8), {bm}-row blocks"
    elif regs:
        family, why = "regs", "Gluon register-dequant wgmma (sm_90)"
    elif choice_bm:
        family, why = "triton_or_regs", (f"prefill_regs=choice: the GPU picks per call between {bm}-row Triton tiles "
                                         f"and {choice_bm}-row register-dequant blocks")
    else:
        family = "triton"
        why = "; ".join(w for w in (gemv_why if cfg.routed_gemv else None, regs_why, choice_why) if w) or "Triton tiles"
        if interpreting():
            why = "TRITON_INTERPRET=1: Triton interpreter tiles"
    decide("kernels", family, why)
    if gemv:
        decide("grouping", "none", "the GEMV indexes pairs directly")
    elif num_pairs:
        decide("grouping", f"{bm}-row blocks", _block_reason(picked, cfg, regs, fp8_why))
    decide("fp8", f"L1={fp8[0]} L2={fp8[1]}", "LMF_ROUTED_FP8 (default L1) on 16-row decode blocks only" if regs
           else "only beside the register-dequant kernels")

    rings: tuple[str, str] | None = None
    regs_cap: tuple[int | None, int | None] | None = None
    if regs:
        k_splits = cfg.regs_split
        decide("k_splits", f"L1={k_splits[0]} L2={k_splits[1]}", split_why and f"{split_why}: whole K" or
               "regs_decode_split: a single token's few programs split K, more pairs run whole K")
        if bm == STAGED_BLOCK_ROWS:
            rings = ("staged", "staged")
            decide("rings", "staged TMA ring (4 stages), 128 registers", "the staged kernels' own ring")
        elif all(fp8):
            rings = ("tma", "tma")
            decide("rings", "L1=tma L2=tma", "the FP8 kernels run their own TMA ring")
        if bm != STAGED_BLOCK_ROWS and not all(fp8):
            picked_rings = regs_weight_rings(num_pairs, bm)
            chosen = [ring_for(picked_rings[i], k // k_splits[i] // STEP_K, k_splits[i]) for i, k in
                      enumerate((latent, inter))]
            chosen = [r if not on else "tma" for r, on in zip(chosen, fp8, strict=True)]
            rings = (chosen[0], chosen[1])
            regs_cap = (max_registers("l1", WEIGHT_RINGS[rings[0]][0], bm),
                        max_registers("l2", WEIGHT_RINGS[rings[1]][0], bm))
            decide("rings", f"L1={rings[0]} L2={rings[1]}", "an FP8 layer: its TMA ring; bf16: weight_rings "
                   "(mxfp4_ring override or measured), ring_for (K slices / partial rounds: loads)")
            decide("maxnreg", f"L1={regs_cap[0]} L2={regs_cap[1]}", "max_registers by ring and block rows "
                   "(mxfp4_maxnreg override)")
    elif gemv:
        k_splits = (1, 1)
        decide("k_splits", "L1=1 L2=1", "the GEMV runs whole K")
    else:
        k_splits = (cfg.l1.split_k, cfg.l2.split_k)
        decide("k_splits", f"L1={k_splits[0]} L2={k_splits[1]}", "Triton tiles: split K for a single token only")
        decide("tiles", f"L1 {cfg.l1.bn}x{cfg.l1.bk} w{cfg.l1.num_warps} s{cfg.l1.num_stages} tma={cfg.l1.tma}; "
                        f"L2 {cfg.l2.bn}x{cfg.l2.bk} w{cfg.l2.num_warps} s{cfg.l2.num_stages} tma={cfg.l2.tma}",
               "pick_config's tiles, K tiles fitted to L and I")

    shared = "none"
    if m_s > 0:
        beside = regs or (gemv and on_cuda)  # as run_experts: the Triton grids then hold no routed tiles
        shared = shared_strategy(m_s) if beside else grid_shared_strategy(m_s)
        if shared == "cublas":
            shared += " first" if in_line_library_first(m_s) else " after L1"
        decide("shared", shared, f"{m_s} shared rows; " + (
            "beside the routed GEMV / register-dequant kernels: shared_strategy (regs_shared override)" if beside
            else "Triton grids hold routed tiles: grid_shared_strategy (grid_shared override)"))
    else:
        decide("shared", "none", "no shared rows in this call")
    group_first = grouping_goes_first(regs, num_tokens)
    if num_pairs and not gemv:
        decide("group_first", group_first, "grouping before the side-stream fork unless a single token beside the "
                                           "register-dequant kernels (group_first override)")
    cap_text = "none (CPU)" if capability is None else f"sm_{capability[0]}{capability[1]}"
    decide("device", cap_text, "given; switches (TRITON_INTERPRET, LMF_ROUTED_FP8, tuning) read from this process")

    return RoutedPlan(num_tokens, num_pairs, capability, family, 0 if gemv or not num_pairs else bm, choice_bm, fp8,
                      k_splits, rings, regs_cap, shared, group_first, cfg, tuple(decisions))


def _block_reason(picked: ProducerConfig, cfg: ProducerConfig, regs: bool, fp8_why: str | None) -> str:
    if fp8_why is not None:
        return f"FP8 blocks dropped ({fp8_why}): decode_block_m"
    if picked.bm != cfg.bm:
        return "decode_block_m: the FP8 layers' K do not fit their rings"
    if any(cfg.routed_fp8):
        return "FP8_BLOCK_M: most hit experts hold a few rows"
    if picked.device_choice_bm:
        return "prefill_regs=choice: the Triton tiles' 128-row blocks (the GPU's other choice beside them)"
    if regs:
        return "decode_block_m (16 / 32) or prefill_regs_block_m (32 / 64 / 128 staged) by rows per expert"
    return "decode_block_m by rows per expert, 128 beyond decode (Triton tiles)"
