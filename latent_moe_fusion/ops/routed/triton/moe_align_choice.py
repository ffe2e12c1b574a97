"""Expert grouping that picks its block size on the GPU (no host sync, capture-safe).

Beyond the decode sizes, the register-dequant kernels in small (64-row) blocks beat the Triton prefill tiles
(128-row blocks) while each local expert holds few rows: every small block streams its expert's weights again.
How many rows that is depends on how many of the batch's ids belong to this rank's experts, which the host cannot
see without reading the ids back. This grouping counts them on the GPU and groups the pairs for one block size
only; the other grouping keeps every block unused (expert -1), so the kernels launched over it read one word per
program and exit. Both kernel families are launched; one of them works.

Pick rule: the small blocks while local pairs <= max_rows x experts hit (mean rows per hit expert <= max_rows).
Then sum_e ceil(c_e / small) <= hits x (max_rows / small + 1), so the small grouping never needs more than
num_experts x (ceil(max_rows / small) + 1) blocks, whatever M is: that bound, not max_blocks, sizes its grids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .moe_align import (
    SPREAD_CHUNK,
    Grouping,
    _count_kernel,
    _owner_chunk,
    _place_chunk,
    _place_owners,
    _plan,
    max_blocks,
)


@dataclass(frozen=True)
class GroupingChoice:
    small: Grouping  # blocks for the register-dequant kernels; all unused unless picked
    large: Grouping  # blocks for the Triton tiles; all unused unless picked
    picked_small: torch.Tensor  # int32 [1]: 1 where the small blocks were picked (read by tests and benchmarks)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return *self.small.tensors(), *self.large.tensors(), self.picked_small


def small_blocks_bound(num_pairs: int, num_experts: int, small_m: int, max_rows: int) -> int:
    """Blocks the small grouping can need when the pick rule takes it (see the module docstring)."""
    return min(max_blocks(num_pairs, num_experts, small_m), num_experts * (triton.cdiv(max_rows, small_m) + 1))


@triton.jit(do_not_specialize=["max_rows"])
def _plan_choice_kernel(
    counts_ptr, picked_ptr, start_s_ptr, cursor_s_ptr, end_s_ptr, start_l_ptr, cursor_l_ptr, end_l_ptr, max_rows,
    SMALL: tl.constexpr, LARGE: tl.constexpr, E_PAD: tl.constexpr,
):
    """One program: the pick, then the block ranges of both groupings, the unpicked one with no rows."""
    counts = tl.load(counts_ptr + tl.arange(0, E_PAD))
    local = tl.sum(counts, 0)
    hits = tl.sum((counts > 0).to(tl.int32), 0)
    small = local <= max_rows * hits
    tl.store(picked_ptr, small.to(tl.int32))
    experts = tl.arange(0, E_PAD)
    tl.store(end_s_ptr + experts, _plan(tl.where(small, counts, 0), start_s_ptr, cursor_s_ptr, SMALL, E_PAD))
    tl.store(end_l_ptr + experts, _plan(tl.where(small, 0, counts), start_l_ptr, cursor_l_ptr, LARGE, E_PAD))


@triton.jit(do_not_specialize=["nb_small", "nb_large"])
def _place_choice_kernel(
    ids_ptr, picked_ptr, num_pairs, num_experts,
    sorted_s_ptr, start_s_ptr, cursor_s_ptr, end_s_ptr, block_expert_s_ptr, nb_small,
    sorted_l_ptr, start_l_ptr, cursor_l_ptr, end_l_ptr, block_expert_l_ptr, nb_large,
    SMALL: tl.constexpr, LARGE: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, NB_CHUNK_S: tl.constexpr,
    NB_CHUNK_L: tl.constexpr,
):
    """The pairs of CHUNK per program take their rows in the picked grouping only; the programs fill both
    groupings' block experts (the unpicked one's all -1)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    if tl.load(picked_ptr) != 0:
        _place_chunk(ids_ptr, sorted_s_ptr, start_s_ptr, cursor_s_ptr, offs, num_pairs, num_experts, SMALL)
    else:
        _place_chunk(ids_ptr, sorted_l_ptr, start_l_ptr, cursor_l_ptr, offs, num_pairs, num_experts, LARGE)
    _place_owners(end_s_ptr, block_expert_s_ptr, nb_small, E_PAD, NB_CHUNK_S)
    _place_owners(end_l_ptr, block_expert_l_ptr, nb_large, E_PAD, NB_CHUNK_L)


def group_by_expert_choice(
    topk_ids: torch.Tensor, num_experts: int, small_m: int, large_m: int, max_rows: int,
) -> GroupingChoice:
    """Group the pairs of topk_ids [M, K] (int32, contiguous) in blocks of small_m rows when the local experts
    hold at most max_rows rows each on average, else in blocks of large_m rows: three launches, no host sync."""
    if not 0 < small_m < large_m or max_rows < 1:
        raise ValueError(f"group_by_expert_choice: need 0 < small_m < large_m and max_rows >= 1, got small_m = "
                         f"{small_m}, large_m = {large_m}, max_rows = {max_rows}")
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    nb_small = small_blocks_bound(num_pairs, num_experts, small_m, max_rows)
    nb_large = max_blocks(num_pairs, num_experts, large_m)
    e_pad = triton.next_power_of_2(num_experts)
    scratch = torch.zeros(7 * e_pad + 1, dtype=torch.int32, device=dev)  # counts, 2 x (starts, cursors, ends), pick
    counts, picked = scratch[:e_pad], scratch[7 * e_pad:]
    start_s, cursor_s, end_s, start_l, cursor_l, end_l = (scratch[i * e_pad:(i + 1) * e_pad] for i in range(1, 7))
    # One allocation for both groupings (host time: prefill runs outside CUDA graphs): rows -1 (padding), block
    # experts written by the place kernel.
    sizes = (nb_small * small_m, nb_small, nb_large * large_m, nb_large)
    rows_s, experts_s, rows_l, experts_l = torch.full((sum(sizes),), -1, dtype=torch.int32, device=dev).split(sizes)
    small = Grouping(rows_s, experts_s, nb_small, small_m)
    large = Grouping(rows_l, experts_l, nb_large, large_m)
    programs = triton.cdiv(max(num_pairs, 1), SPREAD_CHUNK)
    _count_kernel[(programs,)](topk_ids, counts, num_pairs, num_experts, E_PAD=e_pad, CHUNK=SPREAD_CHUNK, num_warps=4)
    _plan_choice_kernel[(1,)](counts, picked, start_s, cursor_s, end_s, start_l, cursor_l, end_l, max_rows,
                              SMALL=small_m, LARGE=large_m, E_PAD=e_pad, num_warps=4)
    _place_choice_kernel[(programs,)](
        topk_ids, picked, num_pairs, num_experts,
        small.sorted_pairs, start_s, cursor_s, end_s, small.block_expert, nb_small,
        large.sorted_pairs, start_l, cursor_l, end_l, large.block_expert, nb_large,
        SMALL=small_m, LARGE=large_m, CHUNK=SPREAD_CHUNK, E_PAD=e_pad,
        NB_CHUNK_S=_owner_chunk(nb_small), NB_CHUNK_L=_owner_chunk(nb_large),
        num_warps=4,
    )
    return GroupingChoice(small, large, picked)
