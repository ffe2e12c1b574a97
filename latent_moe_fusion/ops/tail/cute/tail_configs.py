"""Tile configurations of the CuTe DSL tail kernel, one per M bucket (pure Python: no cutlass import).

Decode sizes use swap-AB: the weight rows (the output's hidden dimension) fill the WGMMA M slot,
which is 64 wide, and the few tokens sit in the N slot (8..128 wide), so no MMA row is wasted on
padding tokens. Prefill uses the plain orientation with 128x128 tiles (two warpgroups) and few
enough pipeline stages that two CTAs share an SM, so one CTA's epilogue (fragment loads) overlaps
the other's mainloop.
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_K = 64  # one 128-byte swizzle row of BF16 per K step
VEC = 8  # epilogue elements per thread access: 16 bytes of BF16
SMEM_BYTES = 232448  # usable shared memory per SM on sm_90 (227 KB)
EPI_PAD = 4  # fp32 padding per staged row: keeps the accumulator stores bank-conflict free


@dataclass(frozen=True)
class CuteTailConfig:
    swap_ab: bool
    mma_m: int  # rows of the MMA tile (hidden if swap_ab, else tokens): 64 per warpgroup
    mma_n: int  # columns of the MMA tile (tokens if swap_ab, else hidden)
    stages: int  # TMA pipeline depth (K steps of TILE_K in flight)

    @property
    def warpgroups(self) -> int:
        return self.mma_m // 64

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def tokens_per_tile(self) -> int:
        return self.mma_n if self.swap_ab else self.mma_m

    @property
    def hidden_per_tile(self) -> int:
        return self.mma_m if self.swap_ab else self.mma_n

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Dynamic shared memory of one CTA: pipeline buffers (reused by the fp32 epilogue staging) + barriers."""
        ab = (self.mma_m + self.mma_n) * TILE_K * elem_bytes * self.stages
        epi = self.tokens_per_tile * (self.hidden_per_tile + EPI_PAD) * 4
        return max(ab, epi) + 1024 + 16 * self.stages

    def label(self) -> str:
        return f"{'swap' if self.swap_ab else 'tile'}:{self.mma_m}x{self.mma_n}x{TILE_K}/st{self.stages}"

    def check(self) -> None:
        if self.mma_m not in (64, 128):
            raise ValueError(f"mma_m must be 64 or 128 (one or two warpgroups), got {self.mma_m}")
        if self.mma_n % 8 or not 8 <= self.mma_n <= 256:
            raise ValueError(f"mma_n must be a multiple of 8 in [8, 256] (WGMMA N), got {self.mma_n}")
        if self.hidden_per_tile % VEC:
            raise ValueError(f"hidden tile {self.hidden_per_tile} must be a multiple of {VEC}")
        if self.threads % (self.hidden_per_tile // VEC):
            raise ValueError(f"{self.threads} threads cannot cover rows of {self.hidden_per_tile // VEC} vectors")
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(f"{self.label()} needs {self.smem_bytes()} bytes of shared memory (> {SMEM_BYTES})")


def _decode(tokens: int, stages: int) -> CuteTailConfig:
    return CuteTailConfig(swap_ab=True, mma_m=64, mma_n=tokens, stages=stages)


PREFILL = CuteTailConfig(swap_ab=False, mma_m=128, mma_n=128, stages=3)

# (largest M of the bucket, config); the first bucket with M <= bound serves M. Decode: one 64-row tile of
# the bucket's tokens per CTA (112 CTAs at N = 7168) as deep as shared memory allows to a point: on the H200
# 12 stages beat 8 by 3-4 % at M = 8 / 32, 10 at M = 64, 8 beat 6 by 9 % at M = 128; smaller token tiles
# (more CTAs) and two warpgroups per CTA were slower everywhere (docs/design/tail.md). M = 16 is unmeasured and takes M = 8 / 32's depth.
# M <= 2 is a bucket of its own (same kernel as M <= 8) because the Triton tail serves it with its CUDA-core
# GEMV (common/tail_gemm/tail_gemm_configs.GEMV_MAX_M), so the measured backend choice can differ there.
TABLE: tuple[tuple[int, CuteTailConfig], ...] = (
    (2, _decode(8, stages=12)),
    (8, _decode(8, stages=12)),
    (16, _decode(16, stages=12)),
    (32, _decode(32, stages=12)),
    (64, _decode(64, stages=10)),
    (128, _decode(128, stages=8)),
    (1 << 62, PREFILL),
)

HIDDEN_MULTIPLE = 128  # every config's hidden tile divides this: N must be a multiple of it


def bucket_bound(m: int) -> int:
    """The largest M of the bucket that serves M (the key of the measured backend choice)."""
    for bound, _ in TABLE:
        if m <= bound:
            return bound
    raise AssertionError("the last bucket is unbounded")


def pick_config(m: int) -> CuteTailConfig:
    for bound, cfg in TABLE:
        if m <= bound:
            return cfg
    raise AssertionError("the last bucket is unbounded")


def all_configs() -> tuple[CuteTailConfig, ...]:
    return tuple(dict.fromkeys(cfg for _, cfg in TABLE))
