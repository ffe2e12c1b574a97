"""The launcher of the routed experts (+ optional shared expert and RMSNorm): it runs the plan that routed_plan.py
makes for the call (which kernels, block rows, buffers, where the shared expert runs, the order) and decides nothing
itself. `python -m latent_moe_fusion plan --m M` prints the plan of a shape.

The launches, in the plan's order:
  1. group_by_expert   ids -> expert blocks (one program, or three launches over many programs from
                       moe_align.SPREAD_MIN_PAIRS pairs on; device-side, capture-safe), or the GPU's choice between
                       two block sizes (moe_align_choice.py); none for the routed GEMV
  2. L1                routed gate/up + SiTU: the routed GEMV (one to four decode tokens), the Gluon register-dequant
                       or FP8 kernels (decode blocks, 32 / 64-row prefill blocks), the staged kernels (128-row prefill
                       blocks) or the Triton tiles (l1_kernel, which also holds the shared expert's gate/up tiles
                       where the shared expert runs in the grids); l1_finish_kernel sums K slices
  3. L2                routed down -> FP32 pair rows (and the shared down-projection in the Triton grid)
  4. combine_kernel    FP32 top-k sum in slot order, one rounding, RMSNorm fused
The shared expert runs in the Triton grids, on a side stream, or as cuBLAS GEMMs in line (schedule_rules.py says
where, by token count). Every size that shapes a grid or buffer is known on the host; nothing reads device data back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from ..common.element_offsets import needs_int64_offsets
from ..common.side_streams import side_stream
from .gluon import KAPPA_KERNELS, launch_routed_l1, launch_routed_l1_fp8, launch_routed_l2, launch_routed_l2_fp8
from .kappa_path import launch_l1_kappa, launch_l2_kappa
from .producer_config import ProducerConfig, interpreting
from .routed_gemv import launch_routed_gemv
from .routed_plan import RoutedPlan, plan_call
from .schedule_rules import layout_fits, weight_layout
from .shared_by_library import shared_by_library
from .split_k_finish import launch_l1_finish
from .triton.combine import launch_combine
from .triton.expert_gemm import l1_kernel, l2_kernel
from .triton.fp8_split_kernel import launch_split_e4m3
from .triton.moe_align import Grouping, group_by_expert
from .triton.moe_align_choice import GroupingChoice, group_by_expert_choice
from .triton.weight_tiles import dot_precision
from .w4a8_path import launch_l1_w4a8, launch_l2_w4a8


@dataclass(frozen=True)
class SharedExpert:
    x_s: torch.Tensor  # [M_s, H]
    w1_s: torch.Tensor  # [I_s, H] gate
    w3_s: torch.Tensor  # [I_s, H] up
    w2_s: torch.Tensor  # [H, I_s] down
    out: torch.Tensor  # [M_s, H] written with round(act_s @ w2_s^T)
    # Called right after the library GEMMs that write `out` are launched, on their stream (the producer starts its
    # fragment exchange there, beside the routed experts); not called where the shared tiles run inside the
    # routed grids or on Triton side grids.
    on_done: Callable[[], None] | None = None


def _weight_strides(w: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, int, int, int, int]:
    if scale is None:
        return w, w.stride(0), w.stride(1), 0, 0
    return scale, w.stride(0), w.stride(1), scale.stride(0), scale.stride(1)


def _descriptor_fits(w: torch.Tensor, bk: int, mxfp4: bool) -> bool:
    return layout_fits(weight_layout(w), bk, mxfp4)


def _weight_descriptor(w: torch.Tensor, bn: int, bk: int, mxfp4: bool):
    """Tensor descriptor over an expert weight's 2D view [E * rows, stored K] with [bn, bk] tiles
    (bk / 2 bytes per row for packed MXFP4)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = w.reshape(w.shape[0] * w.shape[1], w.shape[2])
    cols = bk // 2 if mxfp4 else bk
    row_bytes = flat.stride(0) * flat.element_size()
    if not _descriptor_fits(w, bk, mxfp4):
        raise ValueError(
            f"tma weight tiles need a contiguous weight with 16-byte aligned rows and tiles of >= 16 bytes "
            f"per row (got {tuple(w.shape)} {w.dtype}, {row_bytes} bytes per row, tile {bn}x{cols}); "
            "use a config with tma=False"
        )
    return TensorDescriptor.from_tensor(flat, [bn, cols])


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The shared expert's side stream. A high-priority stream measured the same (docs/design/decode-schedule.md)."""
    return side_stream(device, "shared_expert")


def planned_grouping(
    z: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weight_format: str,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> Grouping | GroupingChoice | None:
    """The expert grouping run_experts(z, topk_ids, ..., shared=None) will use, launched now on the current
    stream (None where that call groups nothing: no pairs, or the GEMV kernels' one to four tokens), so that
    a caller can run it beside other work and pass it in. MXFP4 callers pass the scales (the choice on the GPU
    between two kernel families beyond decode needs them to tell whether both can run)."""
    plan = plan_call(z, topk_ids, w13, w2, w13_scale, w2_scale, weight_format)
    if plan.num_pairs == 0 or plan.config.routed_gemv:
        return None
    return _group(plan, topk_ids, w13.shape[0])


def _group(plan: RoutedPlan, topk_ids: torch.Tensor, num_experts: int) -> Grouping | GroupingChoice:
    """The plan's grouping of these ids, launched on the current stream."""
    if plan.choice_block_m:
        return group_by_expert_choice(topk_ids, num_experts, plan.choice_block_m, plan.config.bm,
                                      plan.choice_max_rows)
    return group_by_expert(topk_ids, num_experts, plan.config.bm)


def _planned_as(grouping: Grouping | GroupingChoice) -> str:
    if isinstance(grouping, GroupingChoice):
        return f"a choice between {grouping.small.block_m}- and {grouping.large.block_m}-row blocks"
    return f"{grouping.block_m}-row blocks ({grouping.nb_max} at most)"


def _check_grouping(plan: RoutedPlan, grouping: Grouping | GroupingChoice | None) -> None:
    """A grouping passed in must be the one the plan launches (planned_grouping on the same arguments)."""
    if grouping is None:
        return
    bm = plan.config.bm
    if plan.choice_block_m:
        if not isinstance(grouping, GroupingChoice) or \
                (grouping.small.block_m, grouping.small.nb_max) != (plan.choice_block_m, plan.choice_blocks):
            raise ValueError(f"grouping: this call picks on the GPU between {bm}-row Triton tiles and "
                             f"{plan.choice_block_m}-row register-dequant blocks, which the given grouping was not "
                             "planned for; plan it with planned_grouping on the same arguments (scales included)")
        grouping = grouping.large
    if not isinstance(grouping, Grouping) or grouping.block_m != bm or grouping.nb_max != plan.max_blocks:
        raise ValueError(f"grouping: planned as {_planned_as(grouping)}, but this call groups by {bm} rows "
                         f"({plan.max_blocks} blocks at most); plan it with planned_grouping on the same arguments")


def run_experts(
    z: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    weight_format: str,
    beta: float,
    lin_beta: float,
    rms_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    shared: SharedExpert | None = None,
    config: ProducerConfig | None = None,
    out: torch.Tensor | None = None,
    grouping: Grouping | GroupingChoice | None = None,
) -> torch.Tensor:
    """Routed experts (rms-normalised if rms_weight is given) [M, L]; also fills shared.out.

    `out` (optional, [M, L] in z.dtype) receives the result; `config` overrides the tile choice;
    `grouping` is planned_grouping's for these ids, already launched (then not grouped again).
    """
    shared_x, shared_w1 = (None, None) if shared is None else (shared.x_s, shared.w1_s)
    plan = plan_call(z, topk_ids, w13, w2, w13_scale, w2_scale, weight_format, shared_x, shared_w1, config)
    _check_grouping(plan, grouping)
    return launch_plan(plan, z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, beta, lin_beta, rms_weight,
                       eps, shared, out, grouping)


def launch_plan(
    plan: RoutedPlan, z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, beta: float, lin_beta: float,
    rms_weight: torch.Tensor | None = None, eps: float = 0.0, shared: SharedExpert | None = None,
    out: torch.Tensor | None = None, grouping: Grouping | GroupingChoice | None = None,
) -> torch.Tensor:
    """Launch what `plan` (plan_call's for these tensors) says, in its order; decides nothing."""
    cfg = plan.config
    m, latent = z.shape
    top_k, num_experts, num_pairs = topk_ids.shape[1], w13.shape[0], plan.num_pairs
    mxfp4 = plan.weight_format == "mxfp4"
    inter = w2.shape[-1] * (2 if mxfp4 else 1)
    bm, nb_max, choice_bm, nb_choice = cfg.bm, plan.max_blocks, plan.choice_block_m, plan.choice_blocks
    regs, gemv, shared_how = plan.regs, plan.gemv, plan.shared
    interp = interpreting()
    dev = z.device

    y = torch.empty_like(z) if out is None else out
    act = torch.empty(max(plan.act_rows, 1), inter, dtype=z.dtype, device=dev)
    split1, split2 = plan.triton_splits
    pairs_shape = (max(num_pairs, 1), latent) if plan.pair_slices == 1 else \
        (plan.pair_slices, max(num_pairs, 1), latent)
    pairs = torch.empty(pairs_shape, dtype=torch.float32, device=dev)

    def shared_as_library() -> None:
        shared_by_library(shared.x_s, shared.w1_s, shared.w3_s, shared.w2_s, shared.out, beta, lin_beta)
        if shared.on_done is not None:
            shared.on_done()

    if plan.library_first:
        shared_as_library()
    choice = None
    if choice_bm:
        choice = grouping if grouping is not None else _group(plan, topk_ids, num_experts)
        grouping = choice.large
    if grouping is None and num_pairs > 0 and plan.group_first and not gemv:
        grouping = group_by_expert(topk_ids, num_experts, bm)
    if grouping is None:  # grids of shared tiles only never read these; int32 like the real ones (kernel types)
        sorted_pairs = block_expert = torch.empty(1, dtype=torch.int32, device=dev)
    else:
        sorted_pairs, block_expert = grouping.sorted_pairs, grouping.block_expert

    w13s, s13_e, s13_n, s13s_e, s13s_n = _weight_strides(w13, w13_scale)
    w2s, s2_e, s2_n, s2s_e, s2s_n = _weight_strides(w2, w2_scale)
    grid_bm = plan.grid_block_m
    if shared_how in ("side", "grid"):
        x_s, w1_s, w3_s, w2_s, s_out = shared.x_s, shared.w1_s, shared.w3_s, shared.w2_s, shared.out
        m_s, hidden = x_s.shape
        inter_s = w1_s.shape[0]
        act_s = torch.empty(m_s, inter_s, dtype=z.dtype, device=dev)
        sh_l1 = triton.cdiv(m_s, grid_bm) * triton.cdiv(inter_s, cfg.l1.shared_bn)
        sh_l2 = triton.cdiv(m_s, grid_bm) * triton.cdiv(hidden, cfg.l2.shared_bn)
    else:
        # No shared work (n_shared_tiles = 0): the shared arguments are never read; sizes like the
        # routed ones keep the compiled kernel the same as the producer's.
        x_s = w1_s = w3_s = w2_s = act_s = s_out = z
        m_s, hidden, inter_s, sh_l1, sh_l2 = 0, latent, inter, 0, 0

    n_rows_r = plan.triton_blocks * bm
    if split1 > 1:  # FP32 gate/up partial sums per K slice, [SPLIT, rows, 2 * width]
        h_part = torch.empty(split1, max(n_rows_r, 1), 2 * inter, dtype=torch.float32, device=dev)
        hs_part = torch.empty(split1, max(m_s, 1), 2 * inter_s, dtype=torch.float32, device=dev)
    else:
        h_part = hs_part = act
    w13_desc = _weight_descriptor(w13, cfg.l1.bn, cfg.l1.bk, mxfp4) if cfg.l1.tma else w13
    w2_desc = _weight_descriptor(w2, cfg.l2.bn, cfg.l2.bk, mxfp4) if cfg.l2.tma else w2
    tiles_r1 = triton.cdiv(inter, cfg.l1.bn)
    tiles_r2 = triton.cdiv(latent, cfg.l2.bn)
    grid1 = (sh_l1 + plan.triton_blocks * tiles_r1) * split1
    grid2 = sh_l2 + plan.triton_blocks * tiles_r2 * split2
    # An operand of the Triton grids past int32 offsets (the activation rows first): they then index in int64 (an
    # addressing width the buffers set, not a choice of the plan's).
    large = needs_int64_offsets(z, act, x_s, act_s, s_out)
    common = dict(BM=grid_bm, MXFP4=mxfp4, DEQUANT=cfg.dequant, INTERPRET=interp,
                  DOT_PREC=dot_precision(z.dtype == torch.float32), LARGE_OFFSETS=large)
    side = _side_stream(dev) if shared_how in ("side", "cublas_side") else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        if shared_how == "cublas_side":
            shared_as_library()
        if grid1 > 0:
            l1_kernel[(grid1,)](
                z, w13, w13s, sorted_pairs, block_expert, act, w13_desc,
                latent, inter, top_k, s13_e, s13_n, s13s_e, s13s_n,
                x_s, w1_s, w3_s, act_s, hidden, inter_s, m_s,
                sh_l1, tiles_r1, triton.cdiv(inter_s, cfg.l1.shared_bn), float(beta), float(lin_beta),
                h_part, hs_part, n_rows_r,
                BN=cfg.l1.bn, BK=cfg.l1.bk, BNS=cfg.l1.shared_bn, BKS=cfg.l1.bk_shared, WDESC=cfg.l1.tma,
                SPLIT=split1, **cfg.l1.launch_options(), **common,
            )
            if split1 > 1:
                launch_l1_finish(h_part, block_expert, act, n_rows_r, inter, hs_part, act_s, m_s, inter_s,
                                 beta, lin_beta, bm, split1, interp)
        if choice is not None:
            launch_routed_l1(z, w13, w13_scale, choice.small.sorted_pairs, choice.small.block_expert, act, nb_choice,
                             choice_bm, top_k, beta, lin_beta)
        if plan.in_line_library and not (regs or gemv):
            shared_as_library()
        if grid2 > 0:
            l2_kernel[(grid2,)](
                act, w2, w2s, sorted_pairs, block_expert, pairs, w2_desc,
                latent, inter, s2_e, s2_n, s2s_e, s2s_n,
                act_s, w2_s, s_out, hidden, inter_s, m_s,
                sh_l2, tiles_r2, triton.cdiv(hidden, cfg.l2.shared_bn), num_pairs,
                BN=cfg.l2.bn, BK=cfg.l2.bk, BNS=cfg.l2.shared_bn, BKS=cfg.l2.bk_shared, WDESC=cfg.l2.tma,
                SPLIT=split2, **cfg.l2.launch_options(), **common,
            )
        if choice is not None:
            launch_routed_l2(act, w2, w2_scale, choice.small.sorted_pairs, choice.small.block_expert, pairs, nb_choice,
                             choice_bm)
    if regs:
        if grouping is None:
            grouping = group_by_expert(topk_ids, num_experts, bm)
        sorted_pairs, block_expert = grouping.sorted_pairs, grouping.block_expert
        if plan.w4a8:
            launch_l1_w4a8(z, w13, w13_scale, sorted_pairs, block_expert, act, nb_max, top_k, beta, lin_beta)
        elif plan.staged_kernel in KAPPA_KERNELS:
            launch_l1_kappa(z, w13, w13_scale, sorted_pairs, block_expert, act, nb_max, top_k, beta, lin_beta,
                            plan.staged_kernel)
        elif cfg.routed_fp8[0]:
            launch_routed_l1_fp8(*launch_split_e4m3(z), w13, w13_scale, sorted_pairs, block_expert, act, nb_max, bm,
                                 top_k, beta, lin_beta)
        else:
            launch_routed_l1(z, w13, w13_scale, sorted_pairs, block_expert, act, nb_max, bm, top_k, beta, lin_beta,
                             cfg.regs_split[0], signal=plan.routed_pdl, staged=plan.staged_kernel)
        if plan.in_line_library:
            shared_as_library()
        if plan.w4a8:
            launch_l2_w4a8(act, w2, w2_scale, sorted_pairs, block_expert, pairs, nb_max)
        elif plan.staged_kernel in KAPPA_KERNELS:
            launch_l2_kappa(act, w2, w2_scale, sorted_pairs, block_expert, pairs, nb_max, plan.staged_kernel)
        elif cfg.routed_fp8[1]:
            parts = launch_split_e4m3(act[: nb_max * bm], sorted_pairs)
            launch_routed_l2_fp8(*parts, w2, w2_scale, sorted_pairs, block_expert, pairs, nb_max, bm)
        else:
            launch_routed_l2(act, w2, w2_scale, sorted_pairs, block_expert, pairs, nb_max, bm,
                             dependent=plan.routed_pdl, staged=plan.staged_kernel)
    if gemv:
        launch_routed_gemv(z, topk_ids, w13, w13_scale, w2, w2_scale, act, pairs, beta, lin_beta, plan.gemv_config,
                           interp, shared_as_library if plan.in_line_library else None)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    launch_combine(pairs, topk_ids, topk_weights, y, rms_weight, eps)
    return y
