"""The rules the routed plan (routed_plan.py) applies, one function per decision, with the thresholds and tuning
overrides they read: the picked config fitted to the weights (resolve_config), where the shared expert runs beside
the routed kernels (shared_strategy, grid_shared_strategy, in_line_library_first) and when the expert grouping goes
before the shared expert's side-stream fork (grouping_goes_first). The launcher (expert_schedule.py) runs what the
plan says and decides nothing itself."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from latent_moe_fusion import tuning

from .gluon import FP8_K_MULTIPLE
from .producer_config import (
    ROUTED_FP8_ENV,
    ProducerConfig,
    config_context,
    decode_block_m,
    pick_config,
    routed_fp8_forced,
)
from .routed_thresholds import ROUTED_THRESHOLDS


def weight_layout(w: torch.Tensor) -> tuple[bool, int, int, int]:
    """What decides whether a weight can take a tensor descriptor: contiguity, bytes per row, base
    address modulo 16, element size."""
    return w.is_contiguous(), w.shape[-1] * w.element_size(), w.data_ptr() % 16, w.element_size()


def layout_fits(layout: tuple[bool, int, int, int], bk: int, mxfp4: bool) -> bool:
    """The copy engine needs a contiguous weight with 16-byte aligned base and rows, and >= 16-byte tile rows."""
    contiguous, row_bytes, base_mod_16, element_size = layout
    cols = bk // 2 if mxfp4 else bk
    return contiguous and row_bytes % 16 == 0 and base_mod_16 == 0 and cols * element_size >= 16


def resolve_config(
    z: torch.Tensor, num_pairs: int, num_experts: int, weight_format: str, inter: int,
    shared_k: tuple[int, int] | None, config: ProducerConfig | None, w13: torch.Tensor, w2: torch.Tensor,
) -> ProducerConfig:
    """The given config (a tma config the weights cannot serve raises), else pick_config's with its
    K tiles fitted and TMA weight tiles dropped where the weights cannot take a descriptor.

    Memoised: working it out costs ~80 us of Python per call on the H200's host (dataclass copies),
    which a prefill forward outside CUDA graphs pays as GPU idle time. The key holds every input,
    the weights' layout and config_context() (the environment and device checks pick_config reads)."""
    return _resolve_config(num_pairs, weight_format, z.dtype, num_experts, (z.shape[1], inter), shared_k, config,
                           weight_layout(w13), weight_layout(w2), config_context())


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
    """A picked config (K tiles fitted) made to fit the weights (weight_layout) and K: TMA weight tiles dropped where a
    weight cannot take a descriptor, FP8 layers dropped where K is no whole number of their rings' rounds."""
    cfg = replace(cfg, l1=replace(cfg.l1, tma=cfg.l1.tma and layout_fits(w13_layout, cfg.l1.bk, mxfp4)),
                  l2=replace(cfg.l2, tma=cfg.l2.tma and layout_fits(w2_layout, cfg.l2.bk, mxfp4)))
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
        cfg = without_fp8(cfg, num_pairs, num_experts)
    elif misfit[1]:
        cfg = replace(cfg, routed_fp8=(True, False))
    return cfg


# Tuning overrides (tuning.py) of the schedule's measured choices.
GROUP_FIRST_OVERRIDE = "group_first"  # A/B switch: True the grouping before the shared expert's side-stream fork, False after
# Beside the regs kernels, up to here the grouping goes after the fork
GROUP_AFTER_FORK_MAX_TOKENS = ROUTED_THRESHOLDS.value("group_after_fork_max_tokens")
SHARED_OVERRIDE = "regs_shared"  # one of SHARED_STRATEGIES
SHARED_STRATEGIES = ("side", "cublas", "cublas_side")
# Up to here: the Triton shared grids on the side stream
SHARED_SIDE_MAX_TOKENS = ROUTED_THRESHOLDS.value("shared_side_max_tokens")
# Up to here: cuBLAS on the side stream; beyond: cuBLAS in line
SHARED_CUBLAS_SIDE_MAX_TOKENS = ROUTED_THRESHOLDS.value("shared_cublas_side_max_tokens")
GRID_SHARED_OVERRIDE = "grid_shared"  # for the Triton routed grids: one of GRID_SHARED_STRATEGIES
GRID_SHARED_STRATEGIES = ("grid", "cublas")
# Prefill beyond: cuBLAS (measured at 4096); decode sizes keep one launch
GRID_SHARED_MAX_TOKENS = ROUTED_THRESHOLDS.value("grid_shared_max_tokens")


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
    """Whether the grouping launches before the shared expert's side-stream fork (routed_plan.py says why): always
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


def without_fp8(cfg: ProducerConfig, num_pairs: int, num_experts: int) -> ProducerConfig:
    """cfg on the bf16 register-dequant kernels: no FP8 layer, the grouping's rows those of the bf16 decode path."""
    return replace(cfg, routed_fp8=(False, False), bm=decode_block_m(num_pairs, num_experts))
