"""Tile configurations of the expert GEMMs, chosen from host-side sizes only (so every rank and
every CUDA-graph replay uses the same kernels). Numbers come from H200 measurements; the reasons are in
docs/design/producer.md, routed-decode.md and prefill.md. The size thresholds are measured data shipped with the
package (routed_thresholds.json, each with its device, date, rule and source; routed_thresholds.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

import torch

from latent_moe_fusion import envs, tuning

from ..common.device_capability import current_capability
from .gluon import BLOCK_ROWS as REGS_BLOCK_M
from .gluon import REGS_OVERRIDE, regs_switched_off
from .routed_gemv import ROUTED_GEMV_MAX_PAIRS, ROUTED_GEMV_OVERRIDE, routed_gemv_setting
from .routed_thresholds import ROUTED_THRESHOLDS
from .triton.weight_tiles import DEQUANT_ASM_PAIRS, DEQUANT_LUT, DEQUANT_TRITON


@dataclass(frozen=True)
class GemmTiles:
    bn: int  # weight rows per program (per half for the gate/up GEMM)
    bk: int
    num_warps: int
    num_stages: int
    bk_shared: int = 0  # K tile of the shared expert's (BF16) tiles in the same launch; 0: same as bk
    maxnreg: int = 0  # register cap per thread (0: none); 128 fits 4 CTAs of 4 warps per SM
    bn_shared: int = 0  # weight rows per shared-expert program; 0: same as bn
    tma: bool = False  # routed weight tiles through tensor descriptors (bulk copies) instead of pointers
    split_k: int = 1  # K slices per tile (L1: routed and shared tiles; L2: routed tiles), summed in FP32

    def __post_init__(self) -> None:
        if self.split_k < 1:
            raise ValueError(f"GemmTiles.split_k must be >= 1, got {self.split_k}")

    @property
    def shared_bn(self) -> int:
        return self.bn_shared or self.bn

    def launch_options(self) -> dict[str, int]:
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts


@dataclass(frozen=True)
class ProducerConfig:
    bm: int  # rows (token, slot pairs) per block: the grouping granularity, shared by L1 and L2
    l1: GemmTiles
    l2: GemmTiles
    dequant: int = DEQUANT_ASM_PAIRS
    # Routed MXFP4 tiles on the Gluon register-dequant kernels (ops/routed/gluon; sm_90, 16, 32 or 64-row
    # blocks): l1 / l2 then shape only the shared expert's tiles.
    routed_regs: bool = False
    # K slices (L1, L2) of the register-dequant kernels (routed_regs only): FP32 partial sums added in
    # slice order (bitwise the same every run), for a single token whose few experts cannot fill the GPU.
    regs_split: tuple[int, int] = (1, 1)
    # Routed MXFP4 experts on the CUDA-core GEMV kernels (routed_gemv.py), one (token, slot)
    # pair at a time, no grouping: for one to four decode tokens. l1 / l2 then shape only the shared expert.
    routed_gemv: bool = False
    # > 0: beyond the decode sizes, the grouping picks on the GPU between these (Triton) tiles and the
    # register-dequant kernels in blocks of this many rows (moe_align_choice.py), by the local experts' rows.
    device_choice_bm: int = 0
    # ROUTED_FP8_ENV (default: L1): (L1, L2) of the register-dequant kernels on FP8 MMAs (gluon/routed_fp8.py:
    # activations split in two e4m3 parts per row; not bitwise the bf16 path), in blocks of FP8_BLOCK_M rows (both
    # layers then: the bf16 L1 has no 8-row path, so L2 alone cannot be FP8).
    routed_fp8: tuple[bool, bool] = (False, False)

    def __post_init__(self) -> None:
        if len(self.regs_split) != 2 or min(self.regs_split) < 1:
            raise ValueError(f"ProducerConfig.regs_split must be two slice counts >= 1, got {self.regs_split}")
        if len(self.routed_fp8) != 2 or (self.routed_fp8[1] and not self.routed_fp8[0]):
            raise ValueError(f"ProducerConfig.routed_fp8 is (L1, L2) on FP8, L2 only with L1; got {self.routed_fp8}")
        if any(self.routed_fp8) and not (self.routed_regs and not self.routed_gemv and self.bm == FP8_BLOCK_M
                                         and self.regs_split == (1, 1)):
            raise ValueError(f"ProducerConfig.routed_fp8 runs the register-dequant kernels (routed_regs=True, "
                             f"routed_gemv=False) in whole K (regs_split=(1, 1)) on {FP8_BLOCK_M}-row blocks "
                             f"(bm={FP8_BLOCK_M}); got bm={self.bm}, routed_regs={self.routed_regs}, "
                             f"routed_gemv={self.routed_gemv}, regs_split={self.regs_split}")

    def with_k_dims(self, routed_k: tuple[int, int], shared_k: tuple[int, int] | None, mxfp4: bool) -> ProducerConfig:
        """Shrink each K tile until it divides its K: routed (L1: L, L2: I), shared (L1: H, L2: I_s)."""
        tiles = []
        for t, rk, sk in ((self.l1, routed_k[0], shared_k and shared_k[0]), (self.l2, routed_k[1], shared_k and shared_k[1])):
            bks = _fit_bk(t.bk_shared or t.bk, (sk or rk,), False)
            tiles.append(replace(t, bk=_fit_bk(t.bk, (rk,), mxfp4), bk_shared=bks))
        return replace(self, l1=tiles[0], l2=tiles[1])


MIN_BK = 16  # tl.dot needs K >= 16


def _fit_bk(bk: int, k_dims: tuple[int, ...], mxfp4: bool) -> int:
    while bk > MIN_BK and any(k % bk for k in k_dims):
        bk //= 2
    if mxfp4 and bk < 32:
        bk = 32  # one E8M0 block per 32; supports() has rejected K dims this cannot divide
    return bk


def interpreting() -> bool:
    return envs.read("TRITON_INTERPRET")


# Up to here (M * top_k) every expert holds few rows: stream weights with BM = 16
DECODE_PAIRS = ROUTED_THRESHOLDS.value("decode_pairs")
DECODE_REGS_BLOCK_M = (16, 32)  # decode blocks the register-dequant kernels take as they are (64: see below)


def rows_per_expert(num_pairs: int, num_experts: int) -> float:
    """Pairs per local expert were every pair local (the op cannot count the local ones without a host sync)."""
    return num_pairs / max(1, min(num_experts, num_pairs))


def decode_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block so that most hit experts need one block (each block streams the expert again)."""
    per_expert = rows_per_expert(num_pairs, num_experts)
    return 16 if per_expert <= 12 else 32 if per_expert <= 24 else 64


# K slices (L1, L2) for a single decode token: it reaches ~2 of a rank's experts, too few programs to
# fill the GPU. H200 (docs/design/producer.md, M = 1): 88 -> 69 us with one token per row, unchanged
# (205 us) with 8 tokens' experts per row; from M = 8 on splitting only adds partial traffic.
SPLIT_K_MAX_PAIRS = ROUTED_THRESHOLDS.value("split_k_max_pairs")
DECODE_SPLIT_K = (2, 2)

REGS_SPLIT_OVERRIDE = "regs_split"  # "L1,L2": tuning override of the register-dequant kernels' K slices
# H200, M = 1 (docs/design/routed-decode.md; two runs, the second with the column-chunked combine): L1 in 4 slices
# and L2 in 2. One token per row (a rank's EP share): routed op 47.1 -> 41.8 and 46.2 -> 40.8 us,
# producer 57.7 -> 57.2 and 56.9 -> 55.1 (its shared expert on the side stream takes the SMs the extra
# programs would use). 8 tokens' experts per row: within +-3 % (145.4 -> 142.4, 141.2 -> 144.9). L2 in
# 4+ slices costs more in the combine's slice sum than it saves.
REGS_DECODE_SPLIT = (4, 2)


def _slice_counts(name: str, value: Any) -> tuple[int, int]:
    try:
        l1, l2 = (int(v) for v in tuning.pair(value, ","))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected two slice counts, e.g. 2,4") from None
    if l1 < 1 or l2 < 1:
        raise ValueError(f"{name}={value!r}: slice counts must be >= 1")
    return l1, l2


tuning.register(REGS_SPLIT_OVERRIDE, _slice_counts)


def regs_decode_split(num_pairs: int) -> tuple[int, int]:
    """K slices of the register-dequant kernels: split for a single token (few programs), never beyond;
    the regs_split override replaces the choice at any size (tuning)."""
    forced = tuning.current().regs_split
    if forced is None:
        return REGS_DECODE_SPLIT if num_pairs <= SPLIT_K_MAX_PAIRS else (1, 1)
    return forced


SHARED_TILES_OVERRIDE = "producer_decode_shared_tiles"  # "BNxBK": tuning override, e.g. "16x128"
DECODE_SHARED_TILES = (32, 64)  # (rows, K) of the MXFP4 decode shared gate/up programs: H200 sweep, docs/design/producer.md


# Beside the register-dequant kernels, a single token's shared expert runs alone in the Triton grids on
# the side stream, and that chain is the producer's critical path at M = 1. H200, whole block in CUDA
# graphs (docs/design/decode-schedule.md): gate/up tiles 32 x 128 in 4 K slices (was 32 x 64 in 2).
REGS_SINGLE_TOKEN_SHARED_TILES = (32, 128)
REGS_SINGLE_TOKEN_SHARED_SPLIT = 4
# Two tokens beside the routed GEMV: 8 slices (H200 block at M = 2: 112.6 us against 115.1 with 4 and 120.7
# unsplit; docs/design/decode-schedule.md). Four tokens keep 4 (130.7 us at M = 4 with 4 slices;
# 141.4 with 8 on another machine, not compared in one process).
FEW_TOKENS_SHARED_SPLIT = 8
FEW_TOKENS_SPLIT_MAX_PAIRS = ROUTED_THRESHOLDS.value("few_tokens_split_max_pairs")


def decode_shared_tiles(default: tuple[int, int] = DECODE_SHARED_TILES) -> tuple[int, int]:
    """The shared-expert gate/up tile of the MXFP4 decode configs. The shared GEMM is I_s / rows
    programs deep in K = H, so narrow tiles spread its BF16 weight stream over more SMs."""
    return tuning.current().producer_decode_shared_tiles or default


def _shared_tiles(name: str, value: Any) -> tuple[int, int]:
    try:
        bn, bk = (int(v) for v in tuning.pair(value.lower() if isinstance(value, str) else value, "x"))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected ROWSxK, e.g. 16x128") from None
    if bn < 16 or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"{name}={value!r}: rows and K must be powers of two >= 16")
    return bn, bk


tuning.register(SHARED_TILES_OVERRIDE, _shared_tiles)


SHARED_SPLIT_OVERRIDE = "producer_shared_split"  # tuning override: K slices of the single-token shared gate/up
SHARED_L2_ROWS_OVERRIDE = "producer_shared_l2_rows"  # tuning override: weight rows per shared down program
SHARED_L2_K_OVERRIDE = "producer_shared_l2_k"  # tuning override: K tile of the shared down programs
# Beside the regs kernels the Triton L2 grid holds only BF16 shared tiles, so the shallow K tile that sized
# shared memory for the routed MXFP4 tiles need not hold. A single token's block: 94.0 / 94.3 / 95.1 us with
# K tiles 64 / 128 / 32 (H200, docs/design/decode-schedule.md); larger M keeps 32 (not measured).
REGS_SINGLE_TOKEN_SHARED_L2_K = 64


tuning.register(SHARED_SPLIT_OVERRIDE, tuning.power_of_two(1))
tuning.register(SHARED_L2_ROWS_OVERRIDE, tuning.power_of_two(16))
tuning.register(SHARED_L2_K_OVERRIDE, tuning.power_of_two(16))


# pick_config's capability argument by default: the current CUDA device's (None without CUDA). routed_plan.py passes
# another to answer for a device this process does not run on.
CURRENT_DEVICE: Final = "current device"


def pick_config(num_pairs: int, weight_format: str, dtype: torch.dtype, num_experts: int = 1 << 30,
                capability: tuple[int, int] | None | str = CURRENT_DEVICE) -> ProducerConfig:
    if interpreting():
        # Few, wide programs: the interpreter's cost is per program and per nested jit call.
        return ProducerConfig(16, GemmTiles(64, 128, 4, 1), GemmTiles(64, 128, 4, 1), DEQUANT_TRITON)
    # Table-lookup dequant: 3-6 % faster than the bias-multiply PTX at every M on the H200
    # (docs/design/producer.md).
    sm90, hopper = _device_flags(capability)
    dequant = DEQUANT_LUT if sm90 else DEQUANT_TRITON
    if dtype == torch.float32:
        return ProducerConfig(16, GemmTiles(32, 32, 4, 2), GemmTiles(32, 32, 4, 2), DEQUANT_TRITON)
    if num_pairs <= DECODE_PAIRS:
        bm = decode_bm = decode_block_m(num_pairs, num_experts)
        regs_bm = 0  # rows per block of the register-dequant kernels, where they take the call
        if weight_format == "mxfp4" and hopper and regs_enabled():
            # 64-row decode blocks: the regs kernels' prefill blocks instead (0: the Triton tiles keep 64)
            regs_bm = bm if bm in DECODE_REGS_BLOCK_M else prefill_regs_block_m(num_pairs, num_experts)
        bm = regs_bm or bm
        if weight_format == "mxfp4":
            # Dequantisation is ALU work: keep shared memory small (shallow shared-expert tiles) so that
            # several CTAs per SM hide its latency. BM = 16: routed weight tiles by TMA, L1 K tiles of
            # 128 in 4 stages without a register cap (H200, M = 32: 1146 us; 1179 with 256 x 3 stages,
            # 1191 with a 128-register cap, 1233 with pointer loads and the bias-multiply dequant;
            # docs/design/producer.md). BM = 32: pointer loads (1457 vs 1505 us by TMA at M = 128) and no
            # cap (1691 vs 1569 us with it).
            # On sm_90 the routed tiles go to the register-dequant kernels (1.3-1.75x faster than these
            # Triton tiles at M = 8 .. 128, docs/design/routed-dequantisation.md); the tiles below then shape the
            # shared expert's programs, and the routed ones wherever the Gluon kernels cannot take a call.
            regs = regs_bm > 0
            gemv = regs and routed_gemv_picked(num_pairs)
            # A token's shared expert shapes (K slices, wide gate/up tiles, deeper down tiles) also serve the
            # routed GEMV's few tokens: there, too, the side stream's shared chain is the critical one.
            single = num_pairs <= SPLIT_K_MAX_PAIRS or gemv
            bn_s, bk_s = decode_shared_tiles(REGS_SINGLE_TOKEN_SHARED_TILES if regs and single else DECODE_SHARED_TILES)
            if regs:
                # The Triton grids then hold only the shared expert's programs (when it runs there, see
                # expert_schedule.shared_strategy). Its K is split for a single token only; more slices
                # (2, 4, 8 from M = 8 on) were slower on the H200 (docs/design/decode-schedule.md).
                split = FEW_TOKENS_SHARED_SPLIT if SPLIT_K_MAX_PAIRS < num_pairs <= FEW_TOKENS_SPLIT_MAX_PAIRS else \
                    REGS_SINGLE_TOKEN_SHARED_SPLIT
                knobs = tuning.current()
                split = (knobs.producer_shared_split or split) if single else 1
                bn2_s = knobs.producer_shared_l2_rows or 64
                bk2_s = knobs.producer_shared_l2_k or (REGS_SINGLE_TOKEN_SHARED_L2_K if single else 32)
                regs_split = regs_decode_split(num_pairs)
                # FP8 (ROUTED_FP8_ENV) where few rows per hit expert are expected (16-row blocks): 8-row blocks then
                # hold most experts' rows. Where the grouping takes 32 rows (M = 128 in the Kimi K3 block) the FP8 L1
                # gained 11 us and L2 lost 12 in 8-row blocks, and the FP8 L1 in 8-row parts of the 32-row blocks
                # gained nothing (docs/design/routed-dequantisation.md): not taken there, nor where the prefill_regs
                # override forces 16-row blocks.
                few_rows = decode_bm == bm == 16
                fp8 = routed_fp8_layers() if not gemv and regs_split == (1, 1) and few_rows else (False, False)
                return ProducerConfig(FP8_BLOCK_M if any(fp8) else bm,
                                      GemmTiles(64, 128, 4, 4, bk_s, 0, bn_s, tma=bm == 16, split_k=split),
                                      GemmTiles(64, 128, 4, 4, bk2_s, 128 if bm == 16 else 0, bn2_s, tma=bm == 16),
                                      dequant, True, regs_split, gemv, routed_fp8=fp8)
            if bm == 16:
                split = DECODE_SPLIT_K if num_pairs <= SPLIT_K_MAX_PAIRS else (1, 1)
                return ProducerConfig(bm, GemmTiles(64, 128, 4, 4, bk_s, 0, bn_s, tma=sm90, split_k=split[0]),
                                      GemmTiles(64, 128, 4, 4, 32, 128, tma=sm90, split_k=split[1]), dequant)
            return ProducerConfig(bm, GemmTiles(64, 128, 4, 4, bk_s, 0, bn_s), GemmTiles(64, 128, 4, 4, 32), dequant)
        return ProducerConfig(bm, GemmTiles(64, 128, 4, 4), GemmTiles(64, 128, 4, 4), dequant)
    if weight_format == "mxfp4":
        prefill_bm = prefill_regs_block_m(num_pairs, num_experts)
        regs = hopper and regs_enabled()
        if prefill_bm and regs:
            # The register-dequant kernels beyond decode: every expert's rows in blocks of prefill_bm; the
            # Triton grids then hold nothing (the shared expert runs by cuBLAS at these sizes).
            return ProducerConfig(prefill_bm, GemmTiles(64, 128, 4, 4), GemmTiles(64, 128, 4, 4, 32), dequant, True,
                                  (1, 1), False)
        choice = PREFILL_REGS_BLOCK_M if regs and prefill_device_choice() else 0
        return ProducerConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3), dequant, device_choice_bm=choice)
    return ProducerConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 3), dequant)


# Beyond the decode blocks of 16 / 32 rows the register-dequant kernels run 64-row blocks: each block dequantises its
# expert's weights once for up to 64 rows (a block with at most 32 or 16 rows runs the narrower MMA). H200, Kimi K3
# rank (112 local experts, top-16), routed op alone (before the staged kernels; docs/design/prefill.md), regs 64 / Triton
# tiles speed by mean rows per hit expert: EP8 share 2.13x at 30 rows (M = 1024), 1.47x at 107 (M = 4096), 1.27x at
# 207 (M = 8192), 1.17x at 396 (M = 16384), 1.10x at 781 (M = 32768); every id local 1.53x at 146 rows (M = 1024),
# 1.15x at 585 (M = 4096), 1.10x at 1170 (M = 8192), 1.03x at 2341 (M = 16384), 0.99x at 4681 (M = 32768). Against
# 32-row blocks 1.07-1.31x from 60 rows on (L1 + L2 alone 1.09-1.27x: docs/design/prefill.md). Where blocks hold few
# rows the 32-row kernels win: 64-row blocks' L1 takes 252 registers (2 CTAs per SM) against 155 (3), and an EP
# share of M = 192 / 256 / 512 (7-16 rows) ran 442 / 539 / 764 us against 413 / 499 / 638. Hence 32-row blocks while
# even the all-local count stays within PREFILL_REGS_FEW_ROWS per expert (M <= 896 at 112 experts; the all-local
# M = 512, 73 rows, is 8 % slower so), 64-row blocks beyond.
# Without a host sync the op cannot see how many of its pairs are local: an EP share has ~1/8 of them, tokens
# dispatched to this rank all of them, so every bound below counts pairs as if all were local. Before the staged kernels the
# host took the regs kernels outright while that count stayed within PREFILL_REGS_MAX_ROWS per expert (M <= 28672 at
# 112 experts; the tiles' margin was gone at 4681 rows) and beyond it let the GPU pick (PREFILL_CHOICE_MAX_ROWS below):
# now the prefill_regs override "choice".
# Beyond PREFILL_STAGED_MIN_ROWS the 128-row blocks of the staged kernels (gluon_kernels/routed_staged.py: each program
# dequantises its weights once into shared memory for 128 rows, asynchronous wgmma) take over, at any size. H200, Kimi
# K3 rank, routed op: staged against 64-row blocks 0.83x at 30 rows per hit expert (EP share of M = 1024), 0.98x at 57
# (2048), 1.13x at 108 (4096), 1.24x at 210, 1.30x at 392; every id local 1.11x at 146 rows (M = 1024), 1.35x at 585
# (M = 4096) (docs/design/prefill.md); against the Triton tiles 1.48x on an EP share of M = 32768 (769 rows)
# and 1.32x with every id local (4681 rows), where the GPU's choice between 64-row blocks and the tiles had run
# 1.09x / 1.00x (prefill_regs.md). The host sees only the all-local count: at 512 of it (M = 3584 at 112 experts, 1/8
# of it local on an EP share) every routing measured is past the crossover.
# "0": the Triton tiles there; "16" / "32" / "64" / "128": those blocks at any size; "choice": the policy before
PREFILL_REGS_OVERRIDE = "prefill_regs"  # tuning override
# Pairs per local expert, were every pair local: 32-row blocks up to here
PREFILL_REGS_FEW_ROWS = ROUTED_THRESHOLDS.value("prefill_regs_few_rows")
PREFILL_REGS_FEW_BLOCK_M = 32
PREFILL_REGS_BLOCK_M = 64
# Pairs per local expert, were every pair local: 128-row staged blocks beyond here
PREFILL_STAGED_MIN_ROWS = ROUTED_THRESHOLDS.value("prefill_staged_min_rows")
PREFILL_STAGED_BLOCK_M = 128
# prefill_regs="choice": the policy before the staged kernels, kept to compare: 32- and 64-row blocks up to
# PREFILL_REGS_MAX_ROWS pairs per local expert counted as if every pair were local, beyond that a choice on the GPU
# between the 64-row blocks and the Triton tiles by the local experts' mean rows (moe_align_choice.py).
PREFILL_CHOICE_SETTING = "choice"
PREFILL_REGS_MAX_ROWS = ROUTED_THRESHOLDS.value("prefill_regs_max_rows")


def _prefill_rows(name: str, value: Any) -> int | str:
    """The override as 0, a block of REGS_BLOCK_M rows or PREFILL_CHOICE_SETTING."""
    if value == PREFILL_CHOICE_SETTING:
        return value
    rows = tuning.whole_number(value)
    if rows not in (0, *REGS_BLOCK_M):
        raise ValueError(f"{name}={value!r}: expected 0 (the Triton tiles), a block of "
                         f"{' or '.join(str(b) for b in REGS_BLOCK_M)} rows for the register-side kernels, "
                         f"{PREFILL_CHOICE_SETTING!r} (the GPU's choice beyond {PREFILL_REGS_MAX_ROWS} rows per expert) "
                         "or None")
    return rows


tuning.register(PREFILL_REGS_OVERRIDE, _prefill_rows)


def prefill_regs_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block of the register-side kernels where the decode blocks end (0: the Triton tiles)."""
    forced = tuning.current().prefill_regs
    if forced in (None, PREFILL_CHOICE_SETTING):
        rows = rows_per_expert(num_pairs, num_experts)
        if rows <= PREFILL_REGS_FEW_ROWS:
            return PREFILL_REGS_FEW_BLOCK_M
        if forced == PREFILL_CHOICE_SETTING:
            return PREFILL_REGS_BLOCK_M if rows <= PREFILL_REGS_MAX_ROWS else 0
        return PREFILL_REGS_BLOCK_M if rows <= PREFILL_STAGED_MIN_ROWS else PREFILL_STAGED_BLOCK_M
    return forced


# Under prefill_regs="choice", beyond that host-side bound the grouping counts the local pairs on the GPU and takes
# the 64-row blocks while the experts it hits hold at most PREFILL_CHOICE_MAX_ROWS rows on average
# (moe_align_choice.py): above, those won up to 2341 rows and tied at 4681 (0.99x there, 1.02x in prefill_regs.md
# before the staged kernels). Both kernel families launch; the unpicked one's programs read their block's expert (-1)
# and exit.
PREFILL_CHOICE_MAX_ROWS = ROUTED_THRESHOLDS.value("prefill_choice_max_rows")


def prefill_device_choice() -> bool:
    """Whether calls beyond prefill_regs_block_m's host-side bound pick their kernels on the GPU
    (prefill_regs="choice")."""
    return tuning.current().prefill_regs == PREFILL_CHOICE_SETTING


def routed_gemv_picked(num_pairs: int) -> bool:
    """The routed GEMV kernels for up to ROUTED_GEMV_MAX_PAIRS pairs (the routed_gemv override False / True forces)."""
    forced, _ = routed_gemv_setting()
    return forced if forced is not None else num_pairs <= ROUTED_GEMV_MAX_PAIRS


# Decode (ProducerConfig.routed_fp8): "1" the L1 on FP8 MMAs (the default); "l1,l2" L2 too; "0" neither.
# H200, the Kimi K3 block compiled with the pass in CUDA graphs, alternating rounds (bench/results/decode_tuning_routed_fp8.md): the
# FP8 L1 1.033 / 1.037 / 1.047 / 1.038x the bf16 kernels at M = 8 / 16 / 32 / 64 (the sizes whose grouping would take
# 16 rows), the block's output 2.4e-3 from the bf16 path's (as far as from eager: bf16 rounding). The FP8 L2 is
# 1.01-1.05x the bf16 one in the same 8-row blocks (bench/results/routed_fp8_layers.md), less than its activations' split costs:
# opt-in. Unset, a call the FP8 kernels cannot take runs the bf16 ones (routed_plan.plan_for); set, it raises.
ROUTED_FP8_ENV = "LMF_ROUTED_FP8"
ROUTED_FP8_CHOICES = {"0": (False, False), "1": (True, False), "l1,l2": (True, True)}
ROUTED_FP8_DEFAULT = "1"
FP8_BLOCK_M = 8  # rows per block on that path: most of a decode batch's hit experts hold a few rows (bench/results/routed_fp8.md)


def routed_switches() -> tuple[str, str, str]:
    """The raw values of the environment variables the routed plan's rules read (routed_plan.py memoises by them)."""
    return envs.raw("TRITON_INTERPRET"), envs.raw(ROUTED_FP8_ENV), envs.raw("LMF_ROUTED_W4A8")



def routed_fp8_forced() -> bool:
    """Whether ROUTED_FP8_ENV is set (to anything but empty): the FP8 path then raises where it cannot run."""
    return envs.is_set(ROUTED_FP8_ENV)


def routed_fp8_layers() -> tuple[bool, bool]:
    """(L1, L2) on FP8 MMAs as ROUTED_FP8_ENV asks (unset: ROUTED_FP8_DEFAULT, the L1)."""
    return ROUTED_FP8_CHOICES[envs.read(ROUTED_FP8_ENV) or ROUTED_FP8_DEFAULT]


def regs_enabled() -> bool:
    return not regs_switched_off()


def _is_hopper() -> bool:
    """sm_90 exactly: the register-dequant kernels use Hopper's warpgroup MMA."""
    return current_capability() == (9, 0)


def _has_sm90() -> bool:
    capability = current_capability()
    return capability is not None and capability >= (9, 0)


def _device_flags(capability: tuple[int, int] | None | str) -> tuple[bool, bool]:
    """(sm_90 or newer, sm_90 exactly) of the given capability; CURRENT_DEVICE asks _has_sm90 / _is_hopper (the
    checks tests replace to stand in for a Hopper GPU)."""
    if capability == CURRENT_DEVICE:
        return _has_sm90(), _is_hopper()
    return capability is not None and capability >= (9, 0), capability == (9, 0)


# Everything besides its arguments that pick_config reads: the environment variables and tuning overrides below and
# the device checks. config_context() snapshots them, so that a cache of picked configs keyed on it
# (schedule_rules.resolve_config) follows every change.
CONFIG_ENVS = ("TRITON_INTERPRET", ROUTED_FP8_ENV)
CONFIG_OVERRIDES = (REGS_OVERRIDE, PREFILL_REGS_OVERRIDE, REGS_SPLIT_OVERRIDE, SHARED_TILES_OVERRIDE,
                    SHARED_SPLIT_OVERRIDE, SHARED_L2_ROWS_OVERRIDE, SHARED_L2_K_OVERRIDE, ROUTED_GEMV_OVERRIDE)


def config_context() -> tuple:
    knobs = tuning.current()
    return (tuple(envs.raw(name) for name in CONFIG_ENVS) + tuple(getattr(knobs, name) for name in CONFIG_OVERRIDES)
            + (_has_sm90(), _is_hopper()))
