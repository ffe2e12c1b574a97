"""Tile configurations of the expert GEMMs, chosen from host-side sizes only (so every rank and
every CUDA-graph replay uses the same kernels). Numbers come from the H200 sweeps recorded in
bench/results/producer_notes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from .weight_tiles import DEQUANT_ASM, DEQUANT_TRITON


@dataclass(frozen=True)
class GemmTiles:
    bn: int  # weight rows per program (per half for the gate/up GEMM)
    bk: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ProducerConfig:
    bm: int  # rows (token, slot pairs) per block: the grouping granularity, shared by L1 and L2
    l1: GemmTiles
    l2: GemmTiles
    dequant: int = DEQUANT_ASM

    def with_k_dims(self, l1_k: tuple[int, ...], l2_k: tuple[int, ...], mxfp4: bool) -> ProducerConfig:
        """Shrink BK until it divides every K of each launch (routed and shared share a launch)."""
        return replace(self, l1=replace(self.l1, bk=_fit_bk(self.l1.bk, l1_k, mxfp4)),
                       l2=replace(self.l2, bk=_fit_bk(self.l2.bk, l2_k, mxfp4)))


MIN_BK = 16  # tl.dot needs K >= 16


def _fit_bk(bk: int, k_dims: tuple[int, ...], mxfp4: bool) -> int:
    while bk > MIN_BK and any(k % bk for k in k_dims):
        bk //= 2
    if mxfp4 and bk < 32:
        bk = 32  # one E8M0 block per 32; supports() has rejected K dims this cannot divide
    return bk


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


DECODE_PAIRS = 4096  # up to here (M * top_k) every expert holds few rows: stream weights with BM = 16


def decode_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block so that most hit experts need one block (each block streams the expert again)."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    return 16 if per_expert <= 12 else 32 if per_expert <= 24 else 64


def pick_config(num_pairs: int, weight_format: str, dtype: torch.dtype, num_experts: int = 1 << 30) -> ProducerConfig:
    if interpreting():
        # Few, wide programs: the interpreter's cost is per program and per nested jit call.
        return ProducerConfig(16, GemmTiles(64, 128, 4, 1), GemmTiles(64, 128, 4, 1), DEQUANT_TRITON)
    dequant = DEQUANT_ASM if _has_sm90() else DEQUANT_TRITON
    if dtype == torch.float32:
        return ProducerConfig(16, GemmTiles(32, 32, 4, 2), GemmTiles(32, 32, 4, 2), DEQUANT_TRITON)
    if num_pairs <= DECODE_PAIRS:
        bm = decode_block_m(num_pairs, num_experts)
        return ProducerConfig(bm, GemmTiles(64, 128, 4, 4), GemmTiles(64, 128, 4, 4), dequant)
    return ProducerConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3), dequant)


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
