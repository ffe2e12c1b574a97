"""Launch configurations of the tail kernels, one per M bucket, measured on an H200 (bench/tail.py).

The table is fixed ahead (no autotuning at call time, so nothing compiles or times inside a CUDA
graph capture); `pick_config` only adjusts split-K upward when N is narrow (hidden_scatter slices)
so that the grid still covers the SMs. docs/design/tail.md says how the entries were chosen.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from latent_moe_fusion import tuning

from ..measured_tables import load_table


@dataclass(frozen=True)
class TailConfig:
    kernel: str  # "gemv" (a few tokens, CUDA cores) | "swap" | "swap_tma" (decode, swap-AB) | "tile" | "tile_tma"
    # (prefill); _tma: descriptor loads
    block_m: int  # gemv: the largest M served (M is padded to a power of two at launch)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # swap kernels only
    group_m: int = 8  # tile kernels only
    persistent: bool = False  # tile kernels only: one program per SM looping over tiles
    preload_k: int = 0  # gemv only: weight columns of every row loaded before a PDL wait (at M = 1; / M beyond)

    def label(self) -> str:
        if self.kernel == "gemv":
            return (f"gemv:{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/st{self.num_stages}"
                    f"/pre{self.preload_k}")
        extra = f"s{self.split_k}" if self.kernel.startswith("swap") else ("p" if self.persistent else "g") + str(self.group_m)
        return (f"{self.kernel}:{self.block_m}x{self.block_n}x{self.block_k}"
                f"/w{self.num_warps}/st{self.num_stages}/{extra}")


# One or two tokens: the CUDA-core GEMV (tail_gemv.py), 4 weight rows per one-warp program, K steps of 512
# at M = 1, 1024 columns loaded before a PDL wait. H200, K = 3584, N = 7168, R = 8 (bench/results/tail_gemv.md): 15.4 /
# 17.9 us at M = 1 / 2 against 18.0 / 18.6 for the swap-AB kernel; 8 to 32 rows per program and K steps
# pipelined through shared memory were slower; from M = 4 on the swap-AB kernel wins (docs/design/tail.md).
# The bound is measured data: tail_thresholds.json beside this file (package data), with its rule and source.
TAIL_THRESHOLDS = load_table(Path(__file__).resolve().with_name("tail_thresholds.json"), ("gemv_max_m",))
GEMV_MAX_M = TAIL_THRESHOLDS.value("gemv_max_m")
GEMV_CONFIG = TailConfig("gemv", GEMV_MAX_M, 4, 512, num_warps=1, num_stages=1, preload_k=1024)
# What serves M <= 2 with the tail_gemv override "off" (and served it before the GEMV).
FEW_TOKENS_SWAP = TailConfig("swap", 16, 64, 128, num_warps=4, num_stages=5, split_k=2)
GEMV_OVERRIDE = "tail_gemv"  # tuning override of the few-token bucket: "off" or ROWSxKxPRELOAD[wWARPS][sSTAGES]
_GEMV_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)(?:w(\d+))?(?:s(\d+))?")

# (largest M of the bucket, config) for BF16; the first bucket with M <= bound serves M.
BF16_TABLE: tuple[tuple[int, TailConfig], ...] = (
    (GEMV_MAX_M, GEMV_CONFIG),
    (16, TailConfig("swap", 16, 64, 128, num_warps=4, num_stages=4, split_k=2)),
    (32, TailConfig("swap", 32, 64, 128, num_warps=4, num_stages=4, split_k=2)),
    (128, TailConfig("tile_tma", 64, 64, 64, num_warps=4, num_stages=6)),
    (512, TailConfig("tile_tma", 64, 128, 64, num_warps=4, num_stages=4)),
    (1 << 62, TailConfig("tile_tma", 128, 256, 64, num_warps=8, num_stages=3)),
)

# float32 inputs use exact (ieee) fp32 dots: correctness, not speed, is the point of this path.
FP32_TABLE: tuple[tuple[int, TailConfig], ...] = (
    (16, TailConfig("swap", 16, 32, 32, num_warps=4, num_stages=2)),
    (1 << 62, TailConfig("tile", 64, 64, 32, num_warps=4, num_stages=2)),
)


def _pow2(v: int) -> bool:
    return v > 0 and not v & (v - 1)


def gemv_override() -> TailConfig | None:
    """The few-token config the tail_gemv override asks for (None: none): "off" gives the swap-AB kernel back,
    "8x512x1024" / "8x512x1024w2s3" a GEMV with those rows per program, K step, preload, warps (4) and
    K steps in flight (1: no pipelining)."""
    spec = tuning.current().tail_gemv
    return None if spec is None else _cached_gemv_config(GEMV_OVERRIDE, spec)


def _gemv_spec(name: str, value: Any) -> str:
    spec = value.strip() if isinstance(value, str) else value
    _gemv_config(name, spec)
    return spec


def _gemv_config(name: str, spec: Any) -> TailConfig:
    if spec == "off":
        return FEW_TOKENS_SWAP
    match = _GEMV_SPEC.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"{name}={spec!r}: expected 'off' or ROWSxKxPRELOAD[wWARPS][sSTAGES], e.g. 4x512x1024w2s1")
    rows, step, preload = (int(g) for g in match.groups()[:3])
    warps = int(match.group(4) or 4)
    stages = int(match.group(5) or 1)
    if not (_pow2(rows) and _pow2(step) and step >= 16 and _pow2(warps) and (preload == 0 or _pow2(preload))
            and 1 <= stages <= 8):
        raise ValueError(f"{name}={spec!r}: rows, K step (>= 16), warps and a non-zero preload must be powers "
                         "of two, stages 1 .. 8")
    return TailConfig("gemv", GEMV_MAX_M, rows, step, num_warps=warps, num_stages=stages, preload_k=preload)


_cached_gemv_config = functools.cache(_gemv_config)  # per call: a spec checked on entry, parsed once
tuning.register(GEMV_OVERRIDE, _gemv_spec)


def table_config(m: int, fp32: bool) -> TailConfig:
    if not fp32 and m <= GEMV_MAX_M:
        forced = gemv_override()
        if forced is not None:
            return forced
    for bound, cfg in FP32_TABLE if fp32 else BF16_TABLE:
        if m <= bound:
            return cfg
    raise AssertionError("the last bucket is unbounded")


def fit_split_k(cfg: TailConfig, n: int, k: int, num_sms: int) -> TailConfig:
    """Raise split-K (powers of 2, K steps kept whole) while the swap grid covers fewer than half the SMs."""
    if not cfg.kernel.startswith("swap"):
        return cfg
    tiles = -(-n // cfg.block_n)
    split = cfg.split_k
    while tiles * split * 2 <= num_sms and k >= cfg.block_k * split * 4 and split < 16:
        split *= 2
    return cfg if split == cfg.split_k else replace(cfg, split_k=split)


def pick_config(m: int, n: int, k: int, fp32: bool, num_sms: int) -> TailConfig:
    return fit_split_k(table_config(m, fp32), n, k, num_sms)
