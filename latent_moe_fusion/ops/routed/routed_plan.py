"""Which routed-expert kernels run for a call, and why: the plan that the launcher (expert_schedule.run_experts) runs.

One pure function, plan_for, decides everything: the kernel family (GEMV, register-dequant, FP8, staged, the GPU's
choice, Triton tiles), the grouping's block rows and buffer sizes, K splits, rings, where the shared expert runs, the
launch order and PDL, each with its reason. It sees a call as a RoutedCall: sizes, the device's capability, and what
the tensors allow (regs_tensor_reason, routed_gemv_tensor_reason). The rules it applies are schedule_rules.py's and
the kernels' own shape checks; the switches they read (TRITON_INTERPRET, LMF_ROUTED_FP8, the tuning overrides) are
read when the plan is made.

- plan_call(z, topk_ids, w13, w2, ...): the plan of a real call (the launcher's);
- plan_routed(num_tokens, ...): the plan of a shape alone (the `plan` command's), assuming the op's own weight layouts
  (RoutedPlan.assumptions says what).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from latent_moe_fusion import tuning

from ..common.device_capability import capability as device_capability
from ..common.pdl import use_pdl_on
from ..common.plan_lines import Decision, plan_lines
from .gluon import (
    STAGED_BLOCK_ROWS,
    STAGED_KERNEL_REASONS,
    STEP_K,
    WEIGHT_RINGS,
    gluon_missing_reason,
    max_registers,
    regs_shape_reason,
    regs_tensor_reason,
    ring_for,
    split_reason,
    staged_kernel,
)
from .gluon import weight_rings as regs_weight_rings
from .producer_config import (
    DECODE_PAIRS,
    PREFILL_CHOICE_MAX_ROWS,
    ROUTED_FP8_ENV,
    SPLIT_K_MAX_PAIRS,
    ProducerConfig,
    interpreting,
    pick_config,
    routed_fp8_forced,
    routed_switches,
    rows_per_expert,
)
from .routed_gemv import RoutedGemvConfig, routed_gemv_setting, routed_gemv_shape_reason, routed_gemv_tensor_reason
from .schedule_rules import (
    fit_picked,
    grid_shared_strategy,
    grouping_goes_first,
    in_line_library_first,
    resolve_config,
    shared_strategy,
    without_fp8,
)
from .triton.moe_align import max_blocks
from .triton.moe_align_choice import small_blocks_bound
from .w4a8_path import routed_w4a8_requested, w4a8_shape_reason

# What a plan of a shape alone cannot see; each is true of the op's own weights (ops/routed/producer_op.py).
ASSUMPTIONS = (
    "weights and scales contiguous, 16-byte aligned, scale shapes matching (else: Triton tiles, no TMA tiles)",
    "activations with unit column stride and even row stride / offset (else: no routed GEMV)",
    "shared-expert K tiles fitted to the routed K only (the shared expert's H and I_s may shrink them)",
)


@dataclass(frozen=True)
class RoutedCall:
    """A routed-experts call as the plan sees it: sizes, the activations' device and what its tensors allow."""

    num_tokens: int
    top_k: int
    num_experts: int
    latent: int  # L
    inter: int  # I
    weight_format: str
    dtype: torch.dtype
    capability: tuple[int, int] | None  # the activations' device; None: not a CUDA device
    shared_rows: int = 0  # the shared expert's rows in the same call (0: none)
    regs_tensor_reason: str | None = None  # why the tensors cannot take the register-dequant kernels
    gemv_tensor_reason: str | None = None  # why the tensors cannot take the routed GEMV

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k


@dataclass(frozen=True)
class RoutedPlan:
    num_tokens: int
    num_pairs: int
    capability: tuple[int, int] | None
    family: str  # "gemv" | "regs" | "regs_fp8" | "staged" | "triton_or_regs" (GPU choice) | "triton" | "none"
    block_m: int  # rows per grouping block (0: no grouping)
    choice_block_m: int  # > 0: the GPU picks between block_m-row Triton tiles and these register-dequant blocks
    fp8_layers: tuple[bool, bool]
    k_splits: tuple[int, int]  # K slices (L1, L2) of the routed kernels that run
    rings: tuple[str, str] | None  # weight rings (L1, L2) of the register-dequant / FP8 / staged kernels
    max_registers: tuple[int | None, int | None] | None
    shared: str  # where the shared expert runs: "none", "grid", "side", "cublas", "cublas_side"
    group_first: bool  # the grouping before the shared expert's side-stream fork
    config: ProducerConfig  # what the launch reads: tiles (K fitted), regs_split, FP8 layers (fallbacks applied)
    decisions: tuple[Decision, ...]  # one line per choice, with its reason
    # What the launcher reads beyond the above.
    gemv: bool = False  # routed tiles on the CUDA-core GEMV kernels
    gemv_config: RoutedGemvConfig | None = None
    regs: bool = False  # routed tiles on the Gluon register-dequant (or FP8, or staged) kernels
    max_blocks: int = 0  # blocks of block_m rows the grouping can need
    choice_blocks: int = 0  # blocks of choice_block_m rows the GPU's choice can need
    choice_max_rows: int = PREFILL_CHOICE_MAX_ROWS  # the GPU's choice: register blocks up to these rows per expert
    act_rows: int = 0  # rows of the SiTU activation buffer
    triton_blocks: int = 0  # routed blocks on the Triton grids
    triton_splits: tuple[int, int] = (1, 1)  # K slices of the Triton grids' L1 and L2
    pair_slices: int = 1  # K slices of the routed L2's FP32 pair rows (the combine adds them)
    grid_block_m: int = 0  # rows per block of the Triton grids (the FP8 path's 8-row blocks: 16)
    library_first: bool = False  # the in-line cuBLAS shared GEMMs before the grouping
    in_line_library: bool = False  # the in-line cuBLAS shared GEMMs right after the routed L1 launch
    routed_pdl: bool = False  # the register-dequant chain launched as programmatic dependents
    w4a8: bool = False  # the staged blocks on FP8 activations (LMF_ROUTED_W4A8, w4a8_path.py)
    staged_kernel: str | None = None  # which kernels run the 128-row blocks (gluon.STAGED_KERNELS)
    weight_format: str = "mxfp4"
    assumptions: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        return plan_lines(self.decisions, self.assumptions)


def regs_reason(call: RoutedCall, block_m: int, fp8: tuple[bool, bool]) -> str | None:
    """Why the call cannot run on the register-dequant kernels in block_m-row blocks (None if it can)."""
    why = regs_shape_reason(call.latent, call.inter, call.dtype, call.weight_format, block_m, fp8, call.capability)
    return why if why is not None else call.regs_tensor_reason


def gemv_reason(call: RoutedCall, cfg: RoutedGemvConfig) -> str | None:
    """Why the call cannot run on the routed GEMV kernels (None if it can)."""
    why = routed_gemv_shape_reason(call.latent, call.inter, call.weight_format, call.num_pairs, cfg, call.dtype,
                                   call.capability is not None)
    return why if why is not None else call.gemv_tensor_reason


def plan_call(
    z: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None, weight_format: str, shared_x: torch.Tensor | None = None,
    shared_w1: torch.Tensor | None = None, config: ProducerConfig | None = None,
) -> RoutedPlan:
    """The plan of run_experts(z, topk_ids, ...) for these tensors; shared_x [M_s, H] and shared_w1 [I_s, H]: the
    shared expert's input and gate weight where the call runs one; config: a given config (it is run as it is, and
    a kernel it names that cannot take the call raises) instead of the picked one."""
    num_tokens, latent = z.shape
    top_k, num_experts = topk_ids.shape[1], w13.shape[0]
    inter = w2.shape[-1] * (2 if weight_format == "mxfp4" else 1)
    shared_k = None if shared_x is None else (shared_x.shape[1], shared_w1.shape[0])
    cfg = resolve_config(z, num_tokens * top_k, num_experts, weight_format, inter, shared_k, config, w13, w2)
    call = RoutedCall(
        num_tokens, top_k, num_experts, latent, inter, weight_format, z.dtype,
        device_capability(z.device.index) if z.is_cuda else None, 0 if shared_x is None else shared_x.shape[0],
        regs_tensor_reason(w13, w2, w13_scale, w2_scale),
        # asked only where the config names the GEMV (plan_for consults it nowhere else): no tensor checks per call
        routed_gemv_tensor_reason(z, w13, w2, w13_scale, w2_scale) if cfg.routed_gemv else None,
    )
    return plan_for(call, cfg, given=config is not None)


def plan_routed(
    num_tokens: int, top_k: int, num_local_experts: int, latent: int, inter: int, weight_format: str = "mxfp4",
    dtype: torch.dtype = torch.bfloat16, capability: tuple[int, int] | None = (9, 0), shared_rows: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RoutedPlan:
    """What run_experts runs for num_tokens tokens of top_k slots over num_local_experts experts of latent size L
    and intermediate size I on a device of this capability, with the op's own weight layouts; shared_rows: the
    shared expert's rows in the same call (None: num_tokens, the producer's case; 0: none); overrides: tuning
    overrides in force (tuning.overrides)."""
    with tuning.overrides(**dict(overrides or {})):
        mxfp4 = weight_format == "mxfp4"
        num_pairs = num_tokens * top_k
        picked = pick_config(num_pairs, weight_format, dtype, num_local_experts, capability=capability)
        cfg = fit_picked(picked.with_k_dims((latent, inter), None, mxfp4), num_pairs, num_local_experts,
                         (latent, inter), mxfp4, *_ideal_layouts(latent, inter, weight_format))
        call = RoutedCall(num_tokens, top_k, num_local_experts, latent, inter, weight_format, dtype, capability,
                          num_tokens if shared_rows is None else shared_rows, gluon_missing_reason(), None)
        return plan_for(call, cfg, given=False, picked=picked, assumptions=ASSUMPTIONS)


def _ideal_layouts(latent: int, inter: int, weight_format: str) -> tuple[tuple, tuple]:
    """schedule_rules.weight_layout of contiguous, aligned w13 [E, 2I, L] and w2 [E, L, I] (MXFP4: two values a
    byte)."""
    if weight_format == "mxfp4":
        return (True, latent // 2, 0, 1), (True, inter // 2, 0, 1)
    return (True, latent * 2, 0, 2), (True, inter * 2, 0, 2)


# The environment variables the plan's rules read (producer_config.routed_switches) and the tuning overrides key the
# memoised plans: working a plan out costs tens of microseconds of host time per call, GPU idle time at prefill.


def plan_for(
    call: RoutedCall, cfg: ProducerConfig, given: bool, picked: ProducerConfig | None = None,
    assumptions: tuple[str, ...] = (),
) -> RoutedPlan:
    """The plan of `call` from its config (resolve_config's: picked and fitted, or given); given: the caller named
    the config, so that a kernel it asks for and the call cannot take raises instead of falling back; picked:
    pick_config's config before fitting (for the reasons only)."""
    return _memoised_plan(call, cfg, given, picked, assumptions, tuning.current(),
                          routed_switches())


@functools.lru_cache(maxsize=1024)
def _memoised_plan(
    call: RoutedCall, cfg: ProducerConfig, given: bool, picked: ProducerConfig | None, assumptions: tuple[str, ...],
    knobs: tuning.TuningOverrides, environment: tuple,  # only keys: the rules read the same state themselves
) -> RoutedPlan:
    return _make_plan(call, cfg, given, picked, assumptions)


def clear_plans() -> None:
    """Forget the memoised plans (tests that replace a rule function call this)."""
    _memoised_plan.cache_clear()


def _make_plan(
    call: RoutedCall, cfg: ProducerConfig, given: bool, picked: ProducerConfig | None, assumptions: tuple[str, ...],
) -> RoutedPlan:
    num_pairs, experts, latent, inter = call.num_pairs, call.num_experts, call.latent, call.inter
    on_cuda = call.capability is not None
    decisions: list[Decision] = []

    def decide(name: str, value: Any, reason: str) -> None:
        decisions.append(Decision(name, str(value), reason))

    per_expert = rows_per_expert(num_pairs, experts)
    where = "interpreter tiles (TRITON_INTERPRET)" if interpreting() else \
        f"decode (<= {DECODE_PAIRS} pairs)" if num_pairs <= DECODE_PAIRS else "prefill"
    decide("pairs", num_pairs, f"{call.num_tokens} tokens x top-{call.top_k}; {per_expert:.1f} per local expert "
                               f"were all local; {where}")

    # The default FP8 path drops to the bf16 kernels where its kernels cannot take the call; asked for by
    # ROUTED_FP8_ENV (or a given config), it stays and the check below says why it cannot run.
    fp8_checked, fp8_why = False, None
    if not given and any(cfg.routed_fp8) and not routed_fp8_forced():
        fp8_why = regs_reason(call, cfg.bm, cfg.routed_fp8)
        if fp8_why is None:
            fp8_checked = True
        else:
            cfg = without_fp8(cfg, num_pairs, experts)

    # Routed tiles on the CUDA-core GEMV kernels (one to four decode tokens): no grouping, pair-indexed rows. A
    # picked config falls back to the kernels below where the GEMV cannot take the call; a given one raises.
    gemv_cfg, gemv_why = None, "not picked: more than the GEMV's pairs, or not MXFP4 on sm_90"
    gemv = cfg.routed_gemv and num_pairs > 0
    if gemv:
        gemv_cfg = routed_gemv_setting()[1]
        gemv_why = gemv_reason(call, gemv_cfg)
        if gemv_why is not None and given:
            raise ValueError(f"config.routed_gemv: the GEMV kernels cannot take this call ({gemv_why}); "
                             "use a config with routed_gemv=False")
        gemv = gemv_why is None
    # Routed tiles on the Gluon register-dequant kernels (sm_90); the Triton grids then hold only the shared
    # expert's tiles. A picked config falls back to the Triton tiles where they cannot take the call; a given one
    # raises.
    regs_why = "not picked: " + ("the routed GEMV takes the call" if gemv else "pick_config keeps the Triton tiles")
    split_why = None
    regs = cfg.routed_regs and num_pairs > 0 and not gemv
    if regs:
        regs_why = None if fp8_checked else regs_reason(call, cfg.bm, cfg.routed_fp8)
        split_why = split_reason(cfg.regs_split, latent, inter) if regs_why is None else None
        if split_why is not None and not given:
            cfg = replace(cfg, regs_split=(1, 1))  # a picked split that does not cut these K: whole K
        elif split_why is not None:
            regs_why = split_why
        if regs_why is not None and any(cfg.routed_fp8) and not given:
            raise ValueError(f"{ROUTED_FP8_ENV}: the FP8 routed kernels cannot take this call ({regs_why}); unset "
                             f"{ROUTED_FP8_ENV} (the bf16 kernels run where FP8 cannot) or set it to 0")
        if regs_why is not None and given:
            raise ValueError(f"config.routed_regs: the register-dequant kernels cannot take this call ({regs_why}); "
                             "use a config with routed_regs=False")
        regs = regs_why is None
    # Beyond decode on Hopper: the grouping picks on the GPU between the Triton tiles (its large blocks) and the
    # register-dequant kernels (its small blocks); both families launch, one works.
    choice_bm, choice_why = 0, None
    if not (regs or gemv) and cfg.device_choice_bm and num_pairs and not (cfg.routed_regs or cfg.routed_gemv):
        choice_why = regs_reason(call, cfg.device_choice_bm, (False, False))
        if choice_why is not None and given:
            raise ValueError(f"config.device_choice_bm: the register-dequant kernels cannot take this call "
                             f"({choice_why}); use a config with device_choice_bm=0")
        choice_bm = cfg.device_choice_bm if choice_why is None else 0

    bm = cfg.bm
    fp8 = cfg.routed_fp8 if regs else (False, False)
    if num_pairs == 0:
        family, why = "none", "no (token, slot) pairs"
    elif gemv:
        family, why = "gemv", f"CUDA-core GEMV per (token, slot) pair: {num_pairs} pairs, no grouping"
    elif regs and bm == STAGED_BLOCK_ROWS:
        family, why = "staged", "Gluon kernels for 128-row prefill blocks (which ones: staged_kernel)"
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
    w4a8 = False
    if routed_w4a8_requested() and num_pairs:
        w4a8_why = f"W4A8 runs the {STAGED_BLOCK_ROWS}-row prefill blocks only (this call: {family})" \
            if family != "staged" else w4a8_shape_reason(latent, inter, call.weight_format, call.dtype, call.capability)
        w4a8 = w4a8_why is None
        decide("activations", "w4a8" if w4a8 else "bf16",
               "LMF_ROUTED_W4A8=1: e4m3 in 1 x 128 blocks on FP8 wgmma" if w4a8 else
               f"LMF_ROUTED_W4A8=1 not taken: {w4a8_why}")
    staged = None
    if family == "staged" and not w4a8:
        staged = staged_kernel()
        decide("staged_kernel", staged, STAGED_KERNEL_REASONS[staged])
    if gemv:
        decide("grouping", "none", "the GEMV indexes pairs directly")
    elif num_pairs:
        decide("grouping", f"{bm}-row blocks", _block_reason(picked, cfg, regs, fp8_why))
    decide("fp8", f"L1={fp8[0]} L2={fp8[1]}", "LMF_ROUTED_FP8 (default L1) on 16-row decode blocks only" if regs
           else "only beside the register-dequant kernels")

    # Buffers and grids: every size is known on the host; nothing reads device data back.
    nb_max = max_blocks(num_pairs, experts, bm) if num_pairs > 0 else 0
    nb_choice = small_blocks_bound(num_pairs, experts, choice_bm, PREFILL_CHOICE_MAX_ROWS) if choice_bm else 0
    act_rows = max(num_pairs if gemv else nb_max * bm, nb_choice * choice_bm)  # one buffer: one family writes it
    split1, split2 = cfg.l1.split_k, cfg.l2.split_k
    pair_slices = cfg.regs_split[1] if regs else 1 if gemv else split2
    if regs or gemv:
        split2 = 1  # the Triton L2 then holds only shared tiles, which are never split

    rings: tuple[str, str] | None = None
    regs_cap: tuple[int | None, int | None] | None = None
    if regs:
        k_splits = cfg.regs_split
        decide("k_splits", f"L1={k_splits[0]} L2={k_splits[1]}", split_why and f"{split_why}: whole K" or
               "regs_decode_split: a single token's few programs split K, more pairs run whole K")
        if bm == STAGED_BLOCK_ROWS:
            rings = ("staged", "staged")
            which = "w4a8" if w4a8 else staged
            decide("rings", BLOCK128_RINGS[which], f"the {which} kernels' own ring")
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

    m_s = call.shared_rows
    shared = "none"
    library_first = False
    if m_s > 0:
        beside = regs or (gemv and on_cuda)  # the Triton grids then hold no routed tiles: place the shared expert
        shared = shared_strategy(m_s) if beside else grid_shared_strategy(m_s)
        library_first = shared == "cublas" and in_line_library_first(m_s)
        shown = shared + (" first" if library_first else " after L1" if shared == "cublas" else "")
        decide("shared", shown, f"{m_s} shared rows; " + (
            "beside the routed GEMV / register-dequant kernels: shared_strategy (regs_shared override)" if beside
            else "Triton grids hold routed tiles: grid_shared_strategy (grid_shared override)") + (
            "; cuBLAS before the grouping at prefill sizes (shared_in_line override)" if shared == "cublas" else ""))
    else:
        decide("shared", "none", "no shared rows in this call")
    in_line_library = shared == "cublas" and not library_first
    group_first = grouping_goes_first(regs, call.num_tokens)
    if num_pairs and not gemv:
        decide("group_first", group_first, "grouping before the side-stream fork unless a single token beside the "
                                           "register-dequant kernels (group_first override)")
    # PDL only for a single token's chain (a few programs), and not with the shared GEMMs between L1 and L2.
    routed_pdl = regs and use_pdl_on("routed", call.capability) and not in_line_library and \
        num_pairs <= SPLIT_K_MAX_PAIRS and not fp8[0]
    if regs:
        decide("pdl", routed_pdl, f"the routed site (pdl_sites override) for <= {SPLIT_K_MAX_PAIRS} pairs on sm_90, "
                                  "bf16 L1, no in-line shared GEMMs between L1 and L2")
    cap_text = "none (CPU)" if call.capability is None else f"sm_{call.capability[0]}{call.capability[1]}"
    decide("device", cap_text, "the activations' device; switches (TRITON_INTERPRET, LMF_ROUTED_FP8, "
                               "LMF_ROUTED_W4A8, tuning) read from this process")

    return RoutedPlan(
        call.num_tokens, num_pairs, call.capability, family, 0 if gemv or not num_pairs else bm, choice_bm, fp8,
        k_splits, rings, regs_cap, shared, group_first, cfg, tuple(decisions),
        gemv=gemv, gemv_config=gemv_cfg, regs=regs, max_blocks=nb_max, choice_blocks=nb_choice,
        choice_max_rows=PREFILL_CHOICE_MAX_ROWS, act_rows=act_rows, triton_blocks=0 if regs or gemv else nb_max, triton_splits=(split1, split2),
        pair_slices=pair_slices, grid_block_m=max(bm, 16) if any(cfg.routed_fp8) else bm,
        library_first=library_first, in_line_library=in_line_library, routed_pdl=routed_pdl, w4a8=w4a8,
        staged_kernel=staged,
        weight_format=call.weight_format,
        assumptions=assumptions,
    )


# How the kernels of the 128-row blocks bring in their operands (the plan's rings line).
BLOCK128_RINGS = {
    "kappa": "weight words by 16-byte loads one step ahead, activations by TMA (3 buffers), 128 registers",
    "kappa_plain": "weight words by 16-byte loads one step ahead, activations by TMA (3 buffers), 128 registers",
    "staged": "weight words by a 4-stage TMA ring, activations by cp.async two steps ahead, 128 registers",
    "ws": "4-stage mbarrier rings between loader, dequantiser and MMA warps, one CTA per SM",
    "w4a8": "weight words by a 4-stage TMA ring, e4m3 activations by cp.async two steps ahead",
}


def _block_reason(picked: ProducerConfig | None, cfg: ProducerConfig, regs: bool, fp8_why: str | None) -> str:
    if fp8_why is not None:
        return f"FP8 blocks dropped ({fp8_why}): decode_block_m"
    if picked is not None and picked.bm != cfg.bm:
        return "decode_block_m: the FP8 layers' K do not fit their rings"
    if any(cfg.routed_fp8):
        return "FP8_BLOCK_M: most hit experts hold a few rows"
    if cfg.device_choice_bm:
        return "prefill_regs=choice: the Triton tiles' 128-row blocks (the GPU's other choice beside them)"
    if regs:
        return "decode_block_m (16 / 32) or prefill_regs_block_m (32 / 64 / 128 staged) by rows per expert"
    return "decode_block_m by rows per expert, 128 beyond decode (Triton tiles)"

