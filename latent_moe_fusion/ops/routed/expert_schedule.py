"""Launch schedule of the routed experts (+ optional shared expert and RMSNorm): four launches.

  1. group_by_expert   ids -> expert blocks (one program, or three launches over many programs from
                       moe_align.SPREAD_MIN_PAIRS pairs on; device-side, capture-safe; beside the
                       register-dequant kernels launched after the shared expert's side-stream fork)
  2. l1_kernel         routed gate/up + SiTU  and  shared gate/up + SiTU   (one grid)
     (l1_finish_kernel  with L1 split along K: SiTU of the ordered sum of the slices)
  3. l2_kernel         routed down -> FP32 pair rows  and  shared down -> fragments (one grid)
  4. combine_kernel    FP32 top-k sum in slot order, one rounding, RMSNorm fused
Every size that shapes a grid or buffer is known on the host; nothing reads device data back.
Beyond GRID_SHARED_MAX_TOKENS the shared expert runs as cuBLAS GEMMs between the two grids instead
(grid_shared_strategy).

MXFP4 beyond decode on sm_90: the register-dequant kernels in 32- or 64-row blocks, taken by the host while every pair
counted as local leaves at most producer_config.PREFILL_REGS_MAX_ROWS rows per expert; beyond, the grouping picks on
the GPU between the Triton tiles and the 64-row blocks (ProducerConfig.device_choice_bm, moe_align_choice.py): both
families' L1 and L2 launch, and the unpicked one's programs exit on their unused blocks.

MXFP4 decode on sm_90: one to four tokens' routed experts run on CUDA-core GEMV kernels (routed_gemv.py:
L1 and L2 per (token, slot) pair, no grouping, then 4.), more tokens' routed tiles of 2 and 3 on the Gluon
register-dequant kernels
(ops/routed/gluon) instead; the shared expert runs in the Triton grids alone or as cuBLAS GEMMs, on a
side stream or in line, by token count (shared_strategy). (The tail's CUDA-core GEMV for a token's
shared down-projection measured no faster in the block: docs/design/decode-schedule.md.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton

from latent_moe_fusion import tuning

from ..common.element_offsets import needs_int64_offsets
from ..common.pdl import use_pdl
from ..common.side_streams import side_stream
from .gluon import (
    FP8_K_MULTIPLE,
    launch_routed_l1,
    launch_routed_l1_fp8,
    launch_routed_l2,
    launch_routed_l2_fp8,
    regs_path_reason,
    split_reason,
)
from .producer_config import (
    PREFILL_CHOICE_MAX_ROWS,
    ROUTED_FP8_ENV,
    SPLIT_K_MAX_PAIRS,
    ProducerConfig,
    config_context,
    decode_block_m,
    interpreting,
    pick_config,
    routed_fp8_forced,
)
from .routed_gemv import launch_routed_gemv, routed_gemv_reason, routed_gemv_setting
from .shared_by_library import shared_by_library
from .split_k_finish import launch_l1_finish
from .triton.combine import launch_combine
from .triton.expert_gemm import l1_kernel, l2_kernel
from .triton.fp8_split_kernel import launch_split_e4m3
from .triton.moe_align import Grouping, group_by_expert, max_blocks
from .triton.moe_align_choice import GroupingChoice, group_by_expert_choice, small_blocks_bound
from .triton.weight_tiles import dot_precision


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


def _layout(w: torch.Tensor) -> tuple[bool, int, int, int]:
    """What decides whether a weight can take a tensor descriptor: contiguity, bytes per row, base
    address modulo 16, element size."""
    return w.is_contiguous(), w.shape[-1] * w.element_size(), w.data_ptr() % 16, w.element_size()


def _layout_fits(layout: tuple[bool, int, int, int], bk: int, mxfp4: bool) -> bool:
    """The copy engine needs a contiguous weight with 16-byte aligned base and rows, and >= 16-byte tile rows."""
    contiguous, row_bytes, base_mod_16, element_size = layout
    cols = bk // 2 if mxfp4 else bk
    return contiguous and row_bytes % 16 == 0 and base_mod_16 == 0 and cols * element_size >= 16


def _descriptor_fits(w: torch.Tensor, bk: int, mxfp4: bool) -> bool:
    return _layout_fits(_layout(w), bk, mxfp4)


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


def resolve_config(
    z: torch.Tensor, num_pairs: int, num_experts: int, weight_format: str, inter: int,
    shared: SharedExpert | None, config: ProducerConfig | None, w13: torch.Tensor, w2: torch.Tensor,
) -> ProducerConfig:
    """The given config (a tma config the weights cannot serve raises), else pick_config's with its
    K tiles fitted and TMA weight tiles dropped where the weights cannot take a descriptor.

    Memoised: working it out costs ~80 us of Python per call on the H200's host (dataclass copies),
    which a prefill forward outside CUDA graphs pays as GPU idle time. The key holds every input,
    the weights' layout and config_context() (the environment and device checks pick_config reads)."""
    shared_k = None if shared is None else (shared.x_s.shape[1], shared.w1_s.shape[0])
    return _resolve_config(num_pairs, weight_format, z.dtype, num_experts, (z.shape[1], inter), shared_k, config,
                           _layout(w13), _layout(w2), config_context())


@functools.lru_cache(maxsize=512)
def _resolve_config(
    num_pairs: int, weight_format: str, dtype: torch.dtype, num_experts: int, routed_k: tuple[int, int],
    shared_k: tuple[int, int] | None, config: ProducerConfig | None, w13_layout: tuple, w2_layout: tuple,
    context: tuple,  # only a key: pick_config reads the same state itself
) -> ProducerConfig:
    mxfp4 = weight_format == "mxfp4"
    cfg = (config or pick_config(num_pairs, weight_format, dtype, num_experts)).with_k_dims(routed_k, shared_k, mxfp4)
    if config is None:
        cfg = fit_picked(cfg, num_pairs, num_experts, routed_k, mxfp4, w13_layout, w2_layout)
    return cfg


def fit_picked(
    cfg: ProducerConfig, num_pairs: int, num_experts: int, routed_k: tuple[int, int], mxfp4: bool,
    w13_layout: tuple, w2_layout: tuple,
) -> ProducerConfig:
    """A picked config (K tiles fitted) made to fit the weights (_layout) and K: TMA weight tiles dropped where a
    weight cannot take a descriptor, FP8 layers dropped where K is no whole number of their rings' rounds."""
    cfg = replace(cfg, l1=replace(cfg.l1, tma=cfg.l1.tma and _layout_fits(w13_layout, cfg.l1.bk, mxfp4)),
                  l2=replace(cfg.l2, tma=cfg.l2.tma and _layout_fits(w2_layout, cfg.l2.bk, mxfp4)))
    # The FP8 kernels' rings run whole rounds: the bf16 kernels take other K (L1: L, L2: I). Asked for by
    # ROUTED_FP8_ENV, a layer that cannot run says so, as run_experts does for its other reasons.
    misfit = [fp8 and k % FP8_K_MULTIPLE != 0 for fp8, k in zip(cfg.routed_fp8, routed_k, strict=True)]
    if any(misfit) and routed_fp8_forced():
        layer = misfit.index(True)
        raise ValueError(f"{ROUTED_FP8_ENV}: the FP8 routed kernels cannot take this call (L{layer + 1}: the "
                         f"{('latent size', 'intermediate size')[layer]} {routed_k[layer]} is not a multiple of "
                         f"{FP8_K_MULTIPLE}); unset {ROUTED_FP8_ENV} (the bf16 kernels run where FP8 cannot) or "
                         "set it to 0")
    if misfit[0]:
        cfg = _without_fp8(cfg, num_pairs, num_experts)
    elif misfit[1]:
        cfg = replace(cfg, routed_fp8=(True, False))
    return cfg


# Tuning overrides (tuning.py) of the schedule's measured choices.
GROUP_FIRST_OVERRIDE = "group_first"  # A/B switch: True the grouping before the shared expert's side-stream fork, False after
GROUP_AFTER_FORK_MAX_TOKENS = 1  # beside the regs kernels, up to here the grouping goes after the fork
SHARED_OVERRIDE = "regs_shared"  # one of SHARED_STRATEGIES
SHARED_STRATEGIES = ("side", "cublas", "cublas_side")
SHARED_SIDE_MAX_TOKENS = 4  # up to here: the Triton shared grids on the side stream
SHARED_CUBLAS_SIDE_MAX_TOKENS = 16  # up to here: cuBLAS on the side stream; beyond: cuBLAS in line
GRID_SHARED_OVERRIDE = "grid_shared"  # for the Triton routed grids: one of GRID_SHARED_STRATEGIES
GRID_SHARED_STRATEGIES = ("grid", "cublas")
GRID_SHARED_MAX_TOKENS = 256  # prefill beyond: cuBLAS (measured at 4096); decode sizes keep one launch


SHARED_IN_LINE_OVERRIDE = "shared_in_line"  # A/B switch for the in-line library GEMMs: "first" | "after_l1"
SHARED_IN_LINE_CHOICES = ("first", "after_l1")
SHARED_IN_LINE_FIRST_MIN_TOKENS = GRID_SHARED_MAX_TOKENS + 1  # prefill: outside CUDA graphs

tuning.register(GROUP_FIRST_OVERRIDE, tuning.switch("group first", "after the fork"))
tuning.register(SHARED_OVERRIDE, tuning.choice(SHARED_STRATEGIES, "where the shared expert runs"))
tuning.register(GRID_SHARED_OVERRIDE, tuning.choice(GRID_SHARED_STRATEGIES, "where the shared expert runs"))
tuning.register(SHARED_IN_LINE_OVERRIDE, tuning.choice(SHARED_IN_LINE_CHOICES, "where the in-line shared GEMMs go"))


def in_line_library_first(m_s: int) -> bool:
    """Whether the shared expert's in-line library GEMMs go before the routed grouping ("first") rather than right
    after the routed L1 launch ("after_l1"). Outside CUDA graphs the host launches the grouping's kernels and L1
    while the GPU may have little queued: with the shared GEMMs (~0.2 ms of GPU at M = 4096) queued first, the GPU
    computes them meanwhile. H200 block at M = 4096, one compile per A/B, back to back: first 2973 /
    3015 against 2998 / 3025 us in two A/Bs (docs/design/prefill.md; the rounds' ranges overlap): at most 10-25 us. The same kernels on one stream: the same bits.
    Decode sizes (in CUDA graphs, no host gaps) keep the order they were tuned with. The shared_in_line override
    forces."""
    forced = tuning.current().shared_in_line
    if forced:
        return forced == "first"
    return m_s >= SHARED_IN_LINE_FIRST_MIN_TOKENS


def shared_strategy(m_s: int) -> str:
    """Where the shared expert runs next to the register-dequant routed kernels.

    side:        the Triton shared-only grids on a side stream, overlapping the routed kernels;
    cublas:      BF16 cuBLAS GEMMs after the routed L1 launch, on the caller's stream;
    cublas_side: the same GEMMs on the side stream.
    The routed kernels are issue-bound, so a concurrent shared expert slows them: overlap pays only
    for a few tokens. H200, whole block compiled + fused in CUDA graphs, the three placements timed in
    one process, side / cublas_side / cublas (us; docs/design/decode-schedule.md):
    M = 1: 108.1 / 109.1 / 116.6, M = 2: 119.3 / 133.5 / 127.4, M = 4: 158.8 / 166.4 / 169.7,
    M = 8: 187.4 / 184.2 / 190.2, M = 12: 226.9 / 220.7 / 227.9, M = 16: 251.8 / 249.9 / 258.2,
    M = 32: 320.5 / 345.3 / 314.4. Re-measured after the decode kernels changed:
    M = 1: side 93.6 / cublas_side 97.0; M = 8: cublas_side 163.5 / side 169.5.
    """
    forced = tuning.current().regs_shared
    if forced:
        return forced
    if m_s <= SHARED_SIDE_MAX_TOKENS:
        return "side"
    return "cublas_side" if m_s <= SHARED_CUBLAS_SIDE_MAX_TOKENS else "cublas"


def grouping_goes_first(regs: bool, num_tokens: int) -> bool:
    """Whether the grouping launches before the shared expert's side-stream fork (run_experts says why): always
    where the Triton grids hold routed tiles; beside the register-dequant kernels from 2 tokens on (group_first
    forces)."""
    forced = tuning.current().group_first
    return not regs or (forced if forced is not None else num_tokens > GROUP_AFTER_FORK_MAX_TOKENS)


def grid_shared_strategy(m_s: int) -> str:
    """Where the shared expert runs when the routed tiles are on the Triton grids: inside them ("grid",
    one launch per layer), or as cuBLAS GEMMs between them ("cublas", beyond GRID_SHARED_MAX_TOKENS).
    H200, whole block at M = 4096 in alternating rounds (docs/design/prefill.md): grid 4622 us,
    cublas 4562 us; the grid's shared tiles took ~270 us against ~190 us for cuBLAS (by kernel time)."""
    forced = tuning.current().grid_shared
    if forced:
        return forced
    return "cublas" if m_s > GRID_SHARED_MAX_TOKENS else "grid"


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The shared expert's side stream. A high-priority stream measured the same (docs/design/decode-schedule.md)."""
    return side_stream(device, "shared_expert")


def device_choice_bm(
    cfg: ProducerConfig, z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None, weight_format: str, num_pairs: int,
) -> tuple[int, str | None]:
    """Rows per register-dequant block where this call picks its routed kernels on the GPU, else 0 (the config
    has no such choice, or the register-dequant kernels cannot take the call: the Triton tiles alone, and the
    second value says why)."""
    bm = cfg.device_choice_bm
    if not bm or num_pairs == 0 or cfg.routed_regs or cfg.routed_gemv:
        return 0, None
    why = regs_path_reason(z, w13, w2, w13_scale, w2_scale, weight_format, bm)
    return (bm, None) if why is None else (0, why)


def _without_fp8(cfg: ProducerConfig, num_pairs: int, num_experts: int) -> ProducerConfig:
    """cfg on the bf16 register-dequant kernels: no FP8 layer, the grouping's rows those of the bf16 decode path."""
    return replace(cfg, routed_fp8=(False, False), bm=decode_block_m(num_pairs, num_experts))


def fp8_fallback(
    cfg: ProducerConfig, config: ProducerConfig | None, z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, weight_format: str, num_pairs: int,
    num_experts: int,
) -> tuple[ProducerConfig, bool]:
    """(cfg, or the bf16 kernels' config where the FP8 path was picked by default (ROUTED_FP8_ENV unset) and its
    kernels cannot take this call (regs_path_reason: weights' layout, device, ...); whether regs_path_reason found
    the returned config's kernels able to take it, so that run_experts need not ask again). Set, the flag asks for
    FP8: run_experts then says why it cannot run."""
    if config is not None or not any(cfg.routed_fp8) or routed_fp8_forced():
        return cfg, False
    if regs_path_reason(z, w13, w2, w13_scale, w2_scale, weight_format, cfg.bm, cfg.routed_fp8) is None:
        return cfg, True
    return _without_fp8(cfg, num_pairs, num_experts), False


def planned_grouping(
    z: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weight_format: str,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> Grouping | GroupingChoice | None:
    """The expert grouping run_experts(z, topk_ids, ..., shared=None) will use, launched now on the current
    stream (None where that call groups nothing: no pairs, or the GEMV kernels' one to four tokens), so that
    a caller can run it beside other work and pass it in. MXFP4 callers pass the scales (the choice on the GPU
    between two kernel families beyond decode needs them to tell whether both can run)."""
    num_pairs, num_experts = topk_ids.numel(), w13.shape[0]
    inter = w2.shape[-1] * (2 if weight_format == "mxfp4" else 1)
    cfg = resolve_config(z, num_pairs, num_experts, weight_format, inter, None, None, w13, w2)
    cfg, _ = fp8_fallback(cfg, None, z, w13, w2, w13_scale, w2_scale, weight_format, num_pairs, num_experts)
    if num_pairs == 0 or cfg.routed_gemv:
        return None
    choice_bm = device_choice_bm(cfg, z, w13, w2, w13_scale, w2_scale, weight_format, num_pairs)[0]
    if choice_bm:
        return group_by_expert_choice(topk_ids, num_experts, choice_bm, cfg.bm, PREFILL_CHOICE_MAX_ROWS)
    return group_by_expert(topk_ids, num_experts, cfg.bm)


def _planned_as(grouping: Grouping | GroupingChoice) -> str:
    if isinstance(grouping, GroupingChoice):
        return f"a choice between {grouping.small.block_m}- and {grouping.large.block_m}-row blocks"
    return f"{grouping.block_m}-row blocks ({grouping.nb_max} at most)"


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
    m, latent = z.shape
    top_k = topk_ids.shape[1]
    num_experts = w13.shape[0]
    mxfp4 = weight_format == "mxfp4"
    inter = w2.shape[-1] * (2 if mxfp4 else 1)
    num_pairs = m * top_k
    cfg = resolve_config(z, num_pairs, num_experts, weight_format, inter, shared, config, w13, w2)
    cfg, fp8_checked = fp8_fallback(cfg, config, z, w13, w2, w13_scale, w2_scale, weight_format, num_pairs,
                                    num_experts)
    bm = cfg.bm
    interp = interpreting()
    prec = dot_precision(z.dtype == torch.float32)
    dev = z.device

    y = torch.empty_like(z) if out is None else out
    nb_max = max_blocks(num_pairs, num_experts, bm) if num_pairs > 0 else 0
    # Routed tiles on the CUDA-core GEMV kernels (one to four decode tokens): no grouping, pair-indexed rows. A
    # picked config falls back to the kernels below where the GEMV cannot take the call; a given one says why.
    gemv = cfg.routed_gemv and num_pairs > 0
    if gemv:
        gemv_cfg = routed_gemv_setting()[1]
        why = routed_gemv_reason(z, w13, w2, w13_scale, w2_scale, weight_format, num_pairs, gemv_cfg)
        if why is not None and config is not None:
            raise ValueError(f"config.routed_gemv: the GEMV kernels cannot take this call ({why}); "
                             "use a config with routed_gemv=False")
        gemv = why is None
    # Routed tiles on the Gluon register-dequant kernels (MXFP4 decode, sm_90); the Triton grids then
    # hold only the shared expert's tiles. A picked config falls back to the Triton tiles where the Gluon
    # kernels cannot take the call; a given one says why.
    regs = cfg.routed_regs and num_pairs > 0 and not gemv  # the GEMV, where it runs, replaces them
    if regs:
        reason = None if fp8_checked else \
            regs_path_reason(z, w13, w2, w13_scale, w2_scale, weight_format, bm, cfg.routed_fp8)
        split_why = split_reason(cfg.regs_split, latent, inter) if reason is None else None
        if split_why is not None and config is None:
            cfg = replace(cfg, regs_split=(1, 1))  # a picked split that does not cut these K: whole K
        elif split_why is not None:
            reason = split_why
        if reason is not None and any(cfg.routed_fp8) and config is None:
            raise ValueError(f"{ROUTED_FP8_ENV}: the FP8 routed kernels cannot take this call ({reason}); unset "
                             f"{ROUTED_FP8_ENV} (the bf16 kernels run where FP8 cannot) or set it to 0")
        if reason is not None and config is not None:
            raise ValueError(f"config.routed_regs: the register-dequant kernels cannot take this call ({reason}); "
                             "use a config with routed_regs=False")
        regs = reason is None
    nb_triton = 0 if regs or gemv else nb_max
    # Beyond decode on Hopper: the grouping picks on the GPU between the Triton tiles (its large blocks) and the
    # register-dequant kernels (its small blocks, at most nb_choice); both families launch, one works.
    choice_bm, choice_why = (0, None) if regs or gemv else \
        device_choice_bm(cfg, z, w13, w2, w13_scale, w2_scale, weight_format, num_pairs)
    if choice_why is not None and config is not None:
        raise ValueError(f"config.device_choice_bm: the register-dequant kernels cannot take this call ({choice_why}); "
                         "use a config with device_choice_bm=0")
    nb_choice = small_blocks_bound(num_pairs, num_experts, choice_bm, PREFILL_CHOICE_MAX_ROWS) if choice_bm else 0
    act_rows = max(num_pairs if gemv else nb_max * bm, nb_choice * choice_bm)  # one buffer: one family writes it
    act = torch.empty(max(act_rows, 1), inter, dtype=z.dtype, device=dev)
    split1, split2 = cfg.l1.split_k, cfg.l2.split_k
    pair_slices = cfg.regs_split[1] if regs else 1 if gemv else split2  # K slices of the routed L2 (combine adds)
    if regs or gemv:
        split2 = 1  # the Triton L2 then holds only shared tiles, which are never split
    pairs_shape = (max(num_pairs, 1), latent) if pair_slices == 1 else (pair_slices, max(num_pairs, 1), latent)
    pairs = torch.empty(pairs_shape, dtype=torch.float32, device=dev)
    shared_how = "none"
    if shared is not None and shared.x_s.shape[0] > 0:
        beside = regs or (gemv and z.is_cuda)  # the Triton grids hold no routed tiles: place the shared expert
        shared_how = shared_strategy(shared.x_s.shape[0]) if beside else grid_shared_strategy(shared.x_s.shape[0])

    def shared_as_library() -> None:
        shared_by_library(shared.x_s, shared.w1_s, shared.w3_s, shared.w2_s, shared.out, beta, lin_beta)
        if shared.on_done is not None:
            shared.on_done()

    # The in-line library GEMMs: before the grouping at prefill sizes (in_line_library_first), else right after the
    # routed L1 launch (in_line_library).
    library_first = shared_how == "cublas" and in_line_library_first(shared.x_s.shape[0])
    if library_first:
        shared_as_library()
    in_line_library = shared_how == "cublas" and not library_first
    # The grouping goes first where the Triton grids hold routed tiles, and beside the register-dequant
    # kernels from 2 tokens on: run beside the shared GEMMs, its one program slowed from 2.7 to 5.7-13 us
    # at M = 8 on the routed chain, the critical one there (H200 block, group first: 111.0 / 148.7 /
    # 202.9 us against 113.7 / 153.2 / 205.6 at M = 2 / 4 / 8; docs/design/decode-schedule.md). A single
    # token's shared chain is the critical one: its grouping goes after the side stream's fork.
    group_first = grouping_goes_first(regs, topk_ids.shape[0])
    choice = None
    if choice_bm:
        choice = grouping if grouping is not None else group_by_expert_choice(
            topk_ids, num_experts, choice_bm, bm, PREFILL_CHOICE_MAX_ROWS)
        if not isinstance(choice, GroupingChoice) or (choice.small.block_m, choice.small.nb_max) != (choice_bm, nb_choice):
            raise ValueError(f"grouping: this call picks on the GPU between {bm}-row Triton tiles and {choice_bm}-row "
                             f"register-dequant blocks, which the given grouping was not planned for; plan it with "
                             "planned_grouping on the same arguments (scales included)")
        grouping = choice.large
    if grouping is not None and (not isinstance(grouping, Grouping) or grouping.block_m != bm
                                 or grouping.nb_max != nb_max):
        raise ValueError(f"grouping: planned as {_planned_as(grouping)}, but this call groups by {bm} rows ({nb_max} "
                         "blocks at most); plan it with planned_grouping on the same arguments")
    if grouping is None and num_pairs > 0 and group_first and not gemv:
        grouping = group_by_expert(topk_ids, num_experts, bm)
    if grouping is None:  # grids of shared tiles only never read these; int32 like the real ones (kernel types)
        sorted_pairs = block_expert = torch.empty(1, dtype=torch.int32, device=dev)
    else:
        sorted_pairs, block_expert = grouping.sorted_pairs, grouping.block_expert

    w13s, s13_e, s13_n, s13s_e, s13s_n = _weight_strides(w13, w13_scale)
    w2s, s2_e, s2_n, s2s_e, s2s_n = _weight_strides(w2, w2_scale)

    # The Triton grids' rows per block: the grouping's, except the FP8 path's 8-row blocks (its grids then hold only
    # shared tiles, whose MMAs take 16 rows at least).
    grid_bm = max(bm, 16) if any(cfg.routed_fp8) else bm
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

    n_rows_r = nb_triton * bm
    if split1 > 1:  # FP32 gate/up partial sums per K slice, [SPLIT, rows, 2 * width]
        h_part = torch.empty(split1, max(n_rows_r, 1), 2 * inter, dtype=torch.float32, device=dev)
        hs_part = torch.empty(split1, max(m_s, 1), 2 * inter_s, dtype=torch.float32, device=dev)
    else:
        h_part = hs_part = act
    w13_desc = _weight_descriptor(w13, cfg.l1.bn, cfg.l1.bk, mxfp4) if cfg.l1.tma else w13
    w2_desc = _weight_descriptor(w2, cfg.l2.bn, cfg.l2.bk, mxfp4) if cfg.l2.tma else w2
    tiles_r1 = triton.cdiv(inter, cfg.l1.bn)
    tiles_r2 = triton.cdiv(latent, cfg.l2.bn)
    grid1 = (sh_l1 + nb_triton * tiles_r1) * split1
    grid2 = sh_l2 + nb_triton * tiles_r2 * split2
    # An operand of the Triton grids past int32 offsets (the activation rows first): they then index in int64.
    large = needs_int64_offsets(z, act, x_s, act_s, s_out)
    common = dict(BM=grid_bm, MXFP4=mxfp4, DEQUANT=cfg.dequant, INTERPRET=interp, DOT_PREC=prec, LARGE_OFFSETS=large)
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
        if in_line_library and not (regs or gemv):
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
        # PDL (ops/common/pdl.py): L2 follows L1 directly unless the shared GEMMs run in line between them.
        # PDL only for a single token's chain (a few programs): from M = 8 on, L2's waiting programs hold SM slots
        # that L1's many blocks need (H200: +9 us at M = 8, -1 to -2 us at M = 1; docs/design/decode-schedule.md).
        pdl = use_pdl("routed", dev) and not in_line_library and num_pairs <= SPLIT_K_MAX_PAIRS
        if grouping is None:
            grouping = group_by_expert(topk_ids, num_experts, bm)
        sorted_pairs, block_expert = grouping.sorted_pairs, grouping.block_expert
        if cfg.routed_fp8[0]:  # whole K (the config says so), no PDL (that is for <= 16 pairs)
            pdl = False
            launch_routed_l1_fp8(*launch_split_e4m3(z), w13, w13_scale, sorted_pairs, block_expert, act, nb_max, bm,
                                 top_k, beta, lin_beta)
        else:
            launch_routed_l1(z, w13, w13_scale, sorted_pairs, block_expert, act, nb_max, bm, top_k, beta, lin_beta,
                             cfg.regs_split[0], signal=pdl)
        if in_line_library:
            shared_as_library()
        if cfg.routed_fp8[1]:
            parts = launch_split_e4m3(act[: nb_max * bm], sorted_pairs)
            launch_routed_l2_fp8(*parts, w2, w2_scale, sorted_pairs, block_expert, pairs, nb_max, bm)
        else:
            launch_routed_l2(act, w2, w2_scale, sorted_pairs, block_expert, pairs, nb_max, bm, dependent=pdl)
    if gemv:
        launch_routed_gemv(z, topk_ids, w13, w13_scale, w2, w2_scale, act, pairs, beta, lin_beta, gemv_cfg, interp,
                           shared_as_library if in_line_library else None)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    launch_combine(pairs, topk_ids, topk_weights, y, rms_weight, eps)
    return y
