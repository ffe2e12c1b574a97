"""Routed MXFP4 experts for one to four decode tokens on the CUDA cores: one (token, slot) pair at a time.

A decode token reaches ~2 of a rank's experts (top-16 of 896 under EP8), one token each. The MMA
kernels then pad every expert block to 16 rows, cut K into slices to find enough programs and add the
slices in two more launches (grouping, L1, L1 finish, L2: 13.4 + 5.8 + 10.1 us at M = 1 for ~34 MB of
weights, bench/results/block_kernels.md). Here a program owns BLOCK_N weight rows of one pair's expert
and the whole K, and multiplies them with that pair's activation row on the CUDA cores:

  L1 (DUAL)  act[p, n]   = round(SiTU(W13[e, n] . z[t], W13[e, I + n] . z[t]))   t = p // top_k
  L2         pairs[p, n] = W2[e, n] . act[p]                                      (FP32, the combine sums)

No grouping: every program reads the (few) expert ids itself, ranks the valid pairs (ids >= 0) in
slot order and walks the items (valid pair, row tile) pid, pid + grid, ... so the grid is fixed on the
host (CUDA graphs) whatever the routing. An expert's weights are read once per pair that uses it: fine
while pairs rarely share an expert (a few tokens), which is when this path is picked.

Numerics (the routed op's contract): weights are exact (code * 2^(scale - 127)), products and sums
FP32, each thread keeps its own (row, k) lanes across the K loop and the lanes are reduced once at the
end; the activation is rounded once. Fixed order: bitwise deterministic.

This file holds the launcher and the configuration; the portable Triton kernel (bit-arithmetic dequantisation of
weight_tiles; the CPU interpreter's path, and off sm_90) is triton/triton_routed_gemv.py. On sm_90 the launcher runs
the Gluon form (gluon/gluon_routed_gemv.py: the prmt table lookup of lut_dequant.py, checked code by code
by tests/ptx_emulator.py, each word's 8 code products summed and then scaled once). The two differ only
in FP32 summation order, and for the E8M0 byte 0, which the table lookup reads as 0 and the portable
kernel (like the reference dequantiser) as 2^-127.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton

from latent_moe_fusion import tuning

from ..common.device_capability import capability
from .routed_thresholds import ROUTED_THRESHOLDS
from .triton.triton_routed_gemv import routed_gemv_kernel


@dataclass(frozen=True)
class RoutedGemvConfig:
    l1_rows: int  # gate rows per item (and as many up rows)
    l2_rows: int  # down rows per item
    words: int  # 32-bit words (8 codes) per row and K step
    num_warps: int
    pair_programs: int  # programs per row tile: the grid is row tiles x min(pairs, pair_programs)
    # GPU kernel: each word's 8 code products summed in FP32 and scaled once (True), or the 8 values
    # scaled in bf16x2 before their FMAs (False; spec suffix "b"). Both exact weights, FP32 sums.
    scale_sums: bool = True
    # GPU kernel: bulk-prefetch each item's weight rows and scales into L2 when it starts (and the program's
    # next item's; spec suffix "f"). Off: on the H200 it slowed the routed op at M = 1 from 23.9 to 29.0 us of
    # kernel time (bench/results/routed_gemv.md).
    prefetch: bool = False
    # GPU kernel: cap on registers per thread (ptxas maxnreg; spec suffix "rN"), so that more one-warp programs
    # fit an SM (None: the compiler's choice).
    max_registers: int | None = None

    def __post_init__(self) -> None:
        for name in ("l1_rows", "l2_rows", "words", "num_warps", "pair_programs"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"RoutedGemvConfig.{name} must be a power of two >= 1, got {v}")
        if self.words < 4:
            raise ValueError(f"RoutedGemvConfig.words must be >= 4 (one E8M0 block), got {self.words}")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(f"RoutedGemvConfig.max_registers must be in 24 .. 255 (or None), got {self.max_registers}")


# H200, Kimi K3 rank (L = 3584, I = 3072), whole block in CUDA graphs: 2 rows per item, registers capped at 80
# (all of a token's 3072 L1 programs fit one wave: 96 registers left 1.16 waves) against the earlier 2x2 for one
# token and 4x4 for two to four: 84.8 / 89.1 / 130.7 us at M = 1 / 2 / 4 against 84.9 / 89.5 / 134.6 (two runs:
# docs/design/routed-decode.md); the routed op alone: bench/results/routed_gemv.md.
ROUTED_GEMV_CONFIG = RoutedGemvConfig(l1_rows=2, l2_rows=2, words=64, num_warps=1, pair_programs=2, max_registers=80)
# Tuning override: False off, True on for any decode size, or a spec L1ROWSxL2ROWSxWORDS[wW][pP][b][f][rR] (on, that shape)
ROUTED_GEMV_OVERRIDE = "routed_gemv"
# (token, slot) pairs up to which pick_config takes this path: four top-16 tokens
ROUTED_GEMV_MAX_PAIRS = ROUTED_THRESHOLDS.value("routed_gemv_max_pairs")
MAX_PAIRS = 1024  # every program ranks all ids in registers


def routed_gemv_setting() -> tuple[bool | None, RoutedGemvConfig]:
    """(forced on / off / None: by size, the configuration) from the routed_gemv override. One configuration
    serves every size (ROUTED_GEMV_CONFIG) unless a spec gives another."""
    forced = tuning.current().routed_gemv
    if forced is None or isinstance(forced, bool):
        return forced, ROUTED_GEMV_CONFIG
    return True, _cached_spec_config(ROUTED_GEMV_OVERRIDE, forced)


def _setting(name: str, value: Any) -> bool | str:
    """The override as True / False, or a spec (checked)."""
    if value in (True, False, "0", "1") and not isinstance(value, float):
        return value in (True, "1")
    _spec_config(name, value)
    return value


def _spec_config(name: str, forced: Any) -> RoutedGemvConfig:
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)(?:w(\d+))?(?:p(\d+))?(b?)(f?)(?:r(\d+))?", forced) \
        if isinstance(forced, str) else None
    if match is None:
        raise ValueError(f"{name}={forced!r}: expected 0, 1 or L1ROWSxL2ROWSxWORDS[wWARPS][pPAIRS][b][f][rREGS], "
                         "e.g. 4x4x64w1p2")
    l1, l2, words, warps, pairs, bf16_scale, prefetch, regs = match.groups()
    base = ROUTED_GEMV_CONFIG
    try:
        cfg = RoutedGemvConfig(int(l1), int(l2), int(words), int(warps or base.num_warps),
                               int(pairs or base.pair_programs), not bf16_scale, bool(prefetch),
                               int(regs) if regs else None)
    except ValueError as err:
        raise ValueError(f"{name}={forced!r}: {err}") from None
    return cfg


_cached_spec_config = functools.cache(_spec_config)  # per call: a spec checked on entry, parsed once
tuning.register(ROUTED_GEMV_OVERRIDE, _setting)


def routed_gemv_reason(
    z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None, weight_format: str, num_pairs: int, cfg: RoutedGemvConfig,
) -> str | None:
    """Why these routed GEMMs cannot run on the GEMV kernels (None if they can)."""
    why = routed_gemv_shape_reason(z.shape[1], w2.shape[-1] * 2, weight_format, num_pairs, cfg, z.dtype, z.is_cuda)
    return why if why is not None else routed_gemv_tensor_reason(z, w13, w2, w13_scale, w2_scale)


def routed_gemv_tensor_reason(
    z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> str | None:
    """routed_gemv_reason's checks of the tensors (asked after routed_gemv_shape_reason's)."""
    for w, s in ((w13, w13_scale), (w2, w2_scale)):
        if not (w.is_contiguous() and s is not None and s.is_contiguous()) or w.data_ptr() % 16 or s.data_ptr() % 16:
            return "weights and scales must be contiguous and 16-byte aligned"
    if z.stride(1) != 1 or z.stride(0) % 2 or z.storage_offset() % 2:
        return "activations need unit column stride, an even row stride and offset (read as bf16 pairs)"
    return None


def routed_gemv_shape_reason(latent: int, inter: int, weight_format: str, num_pairs: int, cfg: RoutedGemvConfig,
                             dtype: torch.dtype, on_cuda: bool) -> str | None:
    """routed_gemv_reason's checks that need no tensor (sizes, dtype, device kind); routed_plan.py asks them for a
    shape alone."""
    if weight_format != "mxfp4":
        return "only MXFP4 weights"
    if num_pairs > MAX_PAIRS:
        return f"at most {MAX_PAIRS} (token, slot) pairs, got {num_pairs}"
    for name, k, rows, n in (("L", latent, cfg.l1_rows, inter), ("I", inter, cfg.l2_rows, latent)):
        if k % (8 * cfg.words):
            return f"K = {name} = {k} must be a multiple of {8 * cfg.words} (the K step of {cfg.words} words)"
        if n % rows:
            return f"{n} output rows do not cut into tiles of {rows}"
    if on_cuda and dtype != torch.bfloat16:
        return f"activations must be bfloat16 on the GPU, got {dtype}"
    return None


def launch_routed_gemv(
    z: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
    w2_scale: torch.Tensor, act: torch.Tensor, pairs: torch.Tensor, beta: float, lin_beta: float,
    cfg: RoutedGemvConfig, interpret: bool, between: Callable[[], None] | None = None, kernel: str = "auto",
) -> None:
    """act[p] (bf16 SiTU rows, [M * top_k, I]) and pairs[p] (FP32 [M * top_k, L]) for every valid pair p;
    rows of invalid pairs are left unwritten (the combine skips them). `between` runs after the L1 launch.
    kernel: "auto" (Gluon on sm_90+ GPUs, else the portable Triton kernel), "gluon" or "triton"."""
    m, top_k = topk_ids.shape
    num_pairs = m * top_k
    latent, inter = z.shape[1], act.shape[1]
    why = routed_gemv_reason(z, w13, w2, w13_scale, w2_scale, "mxfp4", num_pairs, cfg)
    if why is not None:
        raise ValueError(f"launch_routed_gemv: {why}")
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous() or ids.dtype != torch.int32:
        ids = ids.contiguous().to(torch.int32)
    # sm_90+ GPUs run the Gluon form (layouts fixed by hand; its table lookup's bf16x2 multiplies need
    # sm_90); elsewhere, and in the interpreter, the portable Triton kernel runs.
    index = z.device.index if z.device.index is not None else (torch.cuda.current_device() if z.is_cuda else 0)
    gluon = not interpret and z.is_cuda and capability(index) >= (9, 0) and cfg.words % (32 * cfg.num_warps) == 0
    if kernel not in ("auto", "gluon", "triton"):
        raise ValueError(f"kernel={kernel!r}: expected auto, gluon or triton")
    if kernel == "gluon" and not gluon:
        raise ValueError("kernel='gluon' needs an sm_90+ GPU, no interpreter, and words a multiple of 32 x num_warps")
    gluon = gluon and kernel != "triton"
    reg_cap = {} if cfg.max_registers is None or interpret else {"maxnreg": cfg.max_registers}
    block_p = triton.next_power_of_2(num_pairs)
    share = min(num_pairs, cfg.pair_programs)
    w13_words, w2_words = w13.view(torch.int32), w2.view(torch.int32)
    if gluon:
        from .gluon.gluon_routed_gemv import routed_gemv_l1_kernel, routed_gemv_l2_kernel

        l1, l2, l1_opts, l2_opts = routed_gemv_l1_kernel, routed_gemv_l2_kernel, {}, {}
        opts = dict(WPT=cfg.words // (32 * cfg.num_warps), BLOCK_P=block_p, num_warps=cfg.num_warps,
                    FACTOR=cfg.scale_sums, PREFETCH=cfg.prefetch)
        z_in, act_in = z.view(torch.int32), act.view(torch.int32)  # bf16 pairs
    else:
        l1 = l2 = routed_gemv_kernel
        l1_opts, l2_opts = dict(DUAL=True), dict(DUAL=False)
        opts = dict(BLOCK_W=cfg.words, BLOCK_P=block_p, INTERPRET=interpret, num_warps=cfg.num_warps)
        z_in, act_in = z, act
    l1[(inter // cfg.l1_rows * share,)](
        z_in, ids, w13_words, w13_scale, act, num_pairs, top_k, inter, latent // 8, latent // 32,
        w13_words.stride(0), w13_scale.stride(0), z_in.stride(0), act.stride(0), float(beta), float(lin_beta),
        BLOCK_N=cfg.l1_rows, **l1_opts, **opts, **reg_cap,
    )
    if between is not None:
        between()
    l2[(latent // cfg.l2_rows * share,)](
        act_in, ids, w2_words, w2_scale, pairs, num_pairs, top_k, latent, inter // 8, inter // 32,
        w2_words.stride(0), w2_scale.stride(0), act_in.stride(0), pairs.stride(0), 0.0, 0.0,
        BLOCK_N=cfg.l2_rows, **l2_opts, **opts, **reg_cap,
    )
