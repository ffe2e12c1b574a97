"""Launch configurations of the tail kernels, one per M bucket, measured on an H200 (bench/tail.py).

The table is fixed ahead (no autotuning at call time, so nothing compiles or times inside a CUDA
graph capture); `pick_config` only adjusts split-K upward when N is narrow (hidden_scatter slices)
so that the grid still covers the SMs. bench/results/tail_notes.md records how the entries were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TailConfig:
    kernel: str  # "swap" | "swap_tma" (decode, swap-AB) | "tile" | "tile_tma" (prefill); _tma: descriptor loads
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # swap kernels only
    group_m: int = 8  # tile kernels only
    persistent: bool = False  # tile kernels only: one program per SM looping over tiles

    def label(self) -> str:
        extra = f"s{self.split_k}" if self.kernel.startswith("swap") else ("p" if self.persistent else "g") + str(self.group_m)
        return (f"{self.kernel}:{self.block_m}x{self.block_n}x{self.block_k}"
                f"/w{self.num_warps}/st{self.num_stages}/{extra}")


# (largest M of the bucket, config) for BF16; the first bucket with M <= bound serves M.
BF16_TABLE: tuple[tuple[int, TailConfig], ...] = (
    (4, TailConfig("swap", 16, 64, 128, num_warps=4, num_stages=5, split_k=2)),
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


def table_config(m: int, fp32: bool) -> TailConfig:
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
