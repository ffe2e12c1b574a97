"""Device-side token -> expert grouping for the grouped expert GEMMs (no host sync, capture-safe).

The (token, slot) pairs of `topk_ids` [M, K] are grouped by expert into blocks of BM rows:
  sorted_pairs  int32 [NB_MAX * BM]  pair index t*K + j of each row, -1 in the padding rows
  block_expert  int32 [NB_MAX]       expert of each block, -1 for the blocks past the last used one
NB_MAX is a host-side bound that depends only on (M, K, E, BM), so every grid is static:
sum_e ceil(c_e / BM) <= floor(P / BM) + (number of experts hit) with P = M * K pairs.

One program does it all: a histogram of the ids, block offsets by a prefix sum, then each pair
takes a row in its expert's range with an atomic counter. From SPREAD_MIN_PAIRS pairs on (prefill) the
histogram and the placement run over many programs instead (count -> plan -> place, three launches; the place
programs also work out the blocks' experts): one program's two passes over 65536 pairs took 140 us of a 4.5 ms
M = 4096 block on the H200. moe_align_choice.py builds on these steps to pick the block size on the GPU. The rank an
atomic hands out varies run to run, but only the row a pair lands on changes: every row of a GEMM is computed the same way
wherever it sits in the tile, and the combine sums slots in a fixed order, so outputs are bitwise
deterministic. ids < 0 (experts on other ranks) get no row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..routed_thresholds import ROUTED_THRESHOLDS


@dataclass(frozen=True)
class Grouping:
    sorted_pairs: torch.Tensor  # int32 [nb_max * block_m]
    block_expert: torch.Tensor  # int32 [nb_max]
    nb_max: int
    block_m: int

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.sorted_pairs, self.block_expert


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of BM-row blocks any routing of `num_pairs` pairs can need."""
    return max(1, num_pairs // block_m + min(num_experts, num_pairs))


@triton.jit
def _count_chunk(ids_ptr, offs, num_pairs, num_experts, E_PAD: tl.constexpr):
    """Pairs per expert among the pairs `offs`."""
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    valid = (ids >= 0) & (ids < num_experts)
    return tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid)


@triton.jit
def _owners(blk_end, block_expert_ptr, first, stop, step, nb_max, NB_CHUNK: tl.constexpr):
    """Expert of the blocks first + i * step + [0, NB_CHUNK) below stop: the number of experts whose range ends at or
    before the block (experts' ranges in order, blk_end their inclusive prefix sum); -1 past the last used block."""
    total = tl.max(blk_end, 0)
    for b0 in range(first, stop, step):
        blocks = b0 + tl.arange(0, NB_CHUNK)
        owner = tl.sum((blk_end[None, :] <= blocks[:, None]).to(tl.int32), 1)
        owner = tl.where(blocks < total, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < nb_max)


@triton.jit
def _plan(counts, start_ptr, cursor_ptr, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Block ranges per expert (first block in start, row cursors zeroed); returns the ranges' ends, from which
    _owners works out the blocks' experts."""
    experts = tl.arange(0, E_PAD)
    nblk = (counts + BM - 1) // BM
    blk_end = tl.cumsum(nblk, 0)
    tl.store(start_ptr + experts, blk_end - nblk)
    tl.store(cursor_ptr + experts, tl.zeros([E_PAD], dtype=tl.int32))
    return blk_end


@triton.jit
def _place_owners(end_ptr, block_expert_ptr, nb_max, E_PAD: tl.constexpr, NB_CHUNK: tl.constexpr):
    """This program's share of the blocks' experts, from the range ends a plan kernel stored (chunks strided by the
    grid): one program's loop over thousands of blocks took 30-115 us at prefill sizes on the H200."""
    blk_end = tl.load(end_ptr + tl.arange(0, E_PAD))
    _owners(blk_end, block_expert_ptr, tl.program_id(0) * NB_CHUNK, nb_max, tl.num_programs(0) * NB_CHUNK, nb_max,
            NB_CHUNK)


@triton.jit
def _place_chunk(ids_ptr, sorted_ptr, start_ptr, cursor_ptr, offs, num_pairs, num_experts, BM: tl.constexpr):
    """Each valid pair of `offs` takes the next free row of its expert."""
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    valid = (offs < num_pairs) & (ids >= 0) & (ids < num_experts)
    key = tl.where(valid, ids, 0)
    rank = tl.atomic_add(cursor_ptr + key, 1, mask=valid, sem="relaxed")
    start = tl.load(start_ptr + key, mask=valid, other=0)
    tl.store(sorted_ptr + start * BM + rank, offs, mask=valid)


@triton.jit(do_not_specialize=["num_pairs", "nb_max"])
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, start_ptr, cursor_ptr,
    num_pairs, num_experts, nb_max,
    BM: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, NB_CHUNK: tl.constexpr,
):
    """The whole grouping in one program."""
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for p0 in range(0, num_pairs, CHUNK):
        counts += _count_chunk(ids_ptr, p0 + tl.arange(0, CHUNK), num_pairs, num_experts, E_PAD)
    _owners(_plan(counts, start_ptr, cursor_ptr, BM, E_PAD), block_expert_ptr, 0, nb_max, NB_CHUNK, nb_max, NB_CHUNK)
    for r0 in range(0, nb_max * BM, CHUNK):
        rows = r0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + rows, tl.full([CHUNK], -1, tl.int32), mask=rows < nb_max * BM)
    tl.debug_barrier()  # the fills and cursors above are visible to every thread below
    for p0 in range(0, num_pairs, CHUNK):
        _place_chunk(ids_ptr, sorted_ptr, start_ptr, cursor_ptr, p0 + tl.arange(0, CHUNK), num_pairs, num_experts, BM)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Spread step 1: pairs per expert over CHUNK pairs per program, added into counts (zeroed before)."""
    counts = _count_chunk(ids_ptr, tl.program_id(0) * CHUNK + tl.arange(0, CHUNK), num_pairs, num_experts, E_PAD)
    tl.atomic_add(counts_ptr + tl.arange(0, E_PAD), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _plan_kernel(counts_ptr, start_ptr, cursor_ptr, end_ptr, BM: tl.constexpr, E_PAD: tl.constexpr):
    """Spread step 2 (one program): block ranges from the counts."""
    experts = tl.arange(0, E_PAD)
    tl.store(end_ptr + experts, _plan(tl.load(counts_ptr + experts), start_ptr, cursor_ptr, BM, E_PAD))


@triton.jit(do_not_specialize=["nb_max"])
def _place_kernel(ids_ptr, sorted_ptr, start_ptr, cursor_ptr, end_ptr, block_expert_ptr, num_pairs, num_experts,
                  nb_max, BM: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, NB_CHUNK: tl.constexpr):
    """Spread step 3: the pairs of CHUNK per program take their rows; the programs fill the blocks' experts."""
    _place_chunk(ids_ptr, sorted_ptr, start_ptr, cursor_ptr, tl.program_id(0) * CHUNK + tl.arange(0, CHUNK),
                 num_pairs, num_experts, BM)
    _place_owners(end_ptr, block_expert_ptr, nb_max, E_PAD, NB_CHUNK)


def _owner_chunk(nb_max: int) -> int:
    """Blocks per step of the loops that work out the blocks' experts (_owners)."""
    return min(64, triton.next_power_of_2(nb_max))


# From here the grouping runs over many programs (M >= 512 at top-16)
SPREAD_MIN_PAIRS = ROUTED_THRESHOLDS.value("spread_min_pairs")
SPREAD_CHUNK = 1024  # pairs per program of the spread kernels
# The one-program kernel is a chain of dependent steps (histogram, prefix sum, fills, atomics): more warps and
# longer chunks shorten each. H200, Kimi K3 rank (112 local experts, top-16), CUDA graph (docs/design/routed-decode.md,
# 16-row blocks): 16 warps and chunks of 512-2048 pairs, the fastest of 4 / 8 / 16 warps by 512 /
# 1024 / 2048 pairs at every size measured, against 4 warps and the pairs' power of two up to 1024: 5.3 -> 4.9 us
# at M = 8, 6.8 -> 5.9 at 32, 10.5 -> 8.3 at 128, 17.4 -> 12.5 at 256 and 30.0 -> 21.0 at 511.
ALIGN_WARPS = 16
ALIGN_CHUNK = (512, 2048)  # pairs per step of the one-program kernel: the pairs' power of two, within these bounds


def align_chunk(num_pairs: int) -> int:
    """Pairs per step of the one-program kernel (ALIGN_CHUNK)."""
    return min(ALIGN_CHUNK[1], max(ALIGN_CHUNK[0], triton.next_power_of_2(max(num_pairs, 1))))


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, spread: bool | None = None) -> Grouping:
    """Group the pairs of topk_ids [M, K] (int32, contiguous) by expert, padded to block_m rows.

    spread: the many-program kernels (default: from SPREAD_MIN_PAIRS pairs on); same grouping either way,
    up to the order of the pairs inside an expert's rows."""
    num_pairs = topk_ids.numel()
    nb_max = max_blocks(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    e_pad = triton.next_power_of_2(num_experts)
    block_expert = torch.empty(nb_max, dtype=torch.int32, device=dev)
    nb_chunk = _owner_chunk(nb_max)
    if spread if spread is not None else num_pairs >= SPREAD_MIN_PAIRS:
        sorted_pairs = torch.full((nb_max * block_m,), -1, dtype=torch.int32, device=dev)
        scratch = torch.zeros(4 * e_pad, dtype=torch.int32, device=dev)  # counts, block starts, row cursors, ends
        counts, starts, cursors, ends = (scratch[i * e_pad:(i + 1) * e_pad] for i in range(4))
        programs = triton.cdiv(max(num_pairs, 1), SPREAD_CHUNK)
        _count_kernel[(programs,)](topk_ids, counts, num_pairs, num_experts, E_PAD=e_pad, CHUNK=SPREAD_CHUNK,
                                   num_warps=4)
        _plan_kernel[(1,)](counts, starts, cursors, ends, BM=block_m, E_PAD=e_pad, num_warps=4)
        _place_kernel[(programs,)](topk_ids, sorted_pairs, starts, cursors, ends, block_expert, num_pairs,
                                   num_experts, nb_max, BM=block_m, CHUNK=SPREAD_CHUNK, E_PAD=e_pad,
                                   NB_CHUNK=nb_chunk, num_warps=4)
        return Grouping(sorted_pairs, block_expert, nb_max, block_m)
    grouping = Grouping(torch.empty(nb_max * block_m, dtype=torch.int32, device=dev), block_expert, nb_max, block_m)
    launch_one_program(topk_ids, num_experts, grouping, torch.empty(2 * e_pad, dtype=torch.int32, device=dev))
    return grouping


def launch_one_program(topk_ids: torch.Tensor, num_experts: int, grouping: Grouping, scratch: torch.Tensor,
                       warps: int = ALIGN_WARPS, chunk: int | None = None) -> None:
    """The one-program grouping of topk_ids into grouping's buffers (scratch: 2 * E_PAD int32). warps and chunk
    (pairs per step; default align_chunk) override the measured launch for bench/align_launch.py."""
    num_pairs, e_pad = topk_ids.numel(), triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](
        topk_ids, grouping.sorted_pairs, grouping.block_expert, scratch, scratch[e_pad:],
        num_pairs, num_experts, grouping.nb_max,
        BM=grouping.block_m, E_PAD=e_pad, CHUNK=chunk or align_chunk(num_pairs),
        NB_CHUNK=_owner_chunk(grouping.nb_max), num_warps=warps,
    )
