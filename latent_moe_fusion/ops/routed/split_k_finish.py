"""Split-K finish for L1: SiTU of the ordered sum of the FP32 gate/up partials.

At decode a token reaches ~2 of a rank's experts, so L1 has ~100 programs, one per SM, each
streaming a whole K = 3584 alone: one warp per scheduler cannot hide the dequant and load
latency. Cutting K into SPLIT slices multiplies the programs; each slice writes FP32 gate and up
sums, and this kernel adds them in slice order (bitwise the same every run), then applies SiTU
exactly as the unsplit L1 epilogue does (routed rows: FP32 h; shared rows: g and u rounded to the
activation dtype first, as the unfused nn.Linear outputs are). L2's slices are summed by the
combine (combine.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.gdc import release_dependents, wait_for_predecessor
from ..common.triton_numerics import round_to, situ


@triton.jit
def _sum_slices(part_ptr, row, n_rows, cols, mask, width, SPLIT: tl.constexpr):
    g = tl.zeros(cols.shape, dtype=tl.float32)
    u = tl.zeros(cols.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        base = part_ptr + (s * n_rows + row).to(tl.int64) * (2 * width)
        g += tl.load(base + cols, mask=mask, other=0.0)
        u += tl.load(base + width + cols, mask=mask, other=0.0)
    return g, u


@triton.jit(do_not_specialize=["n_rows_r", "m_s"])
def l1_finish_kernel(
    h_part_ptr, block_expert_ptr, act_ptr, n_rows_r, inter,
    hs_part_ptr, act_s_ptr, m_s, inter_s, beta, lin_beta,
    BM: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # a programmatic dependent of L1 that lets its own dependent (L2) launch at once
        release_dependents()
        wait_for_predecessor()
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if row < n_rows_r:
        # Rows of blocks L1 skipped (no expert) hold no partials; L2 skips them too.
        if tl.load(block_expert_ptr + row // BM) >= 0:
            mask = cols < inter
            g, u = _sum_slices(h_part_ptr, row, n_rows_r, cols, mask, inter, SPLIT)
            act = round_to(situ(g, u, beta, lin_beta), act_ptr.dtype.element_ty, INTERPRET)
            tl.store(act_ptr + row.to(tl.int64) * inter + cols, act, mask=mask)
    else:
        tok = row - n_rows_r
        mask = cols < inter_s
        g, u = _sum_slices(hs_part_ptr, tok, m_s, cols, mask, inter_s, SPLIT)
        dtype = act_s_ptr.dtype.element_ty
        g = round_to(g, dtype, INTERPRET).to(tl.float32)
        u = round_to(u, dtype, INTERPRET).to(tl.float32)
        act = round_to(situ(g, u, beta, lin_beta), dtype, INTERPRET)
        tl.store(act_s_ptr + tok.to(tl.int64) * inter_s + cols, act, mask=mask)


FINISH_BLOCK = 1024


def launch_l1_finish(
    h_part, block_expert, act, n_rows_r: int, inter: int, hs_part, act_s, m_s: int, inter_s: int,
    beta: float, lin_beta: float, bm: int, split: int, interpret: bool, pdl: bool = False,
) -> None:
    """pdl: launch as a programmatic dependent (the L1 before it signals early; ops/common/pdl.py)."""
    rows = n_rows_r + m_s
    if rows == 0:
        return
    block = min(FINISH_BLOCK, triton.next_power_of_2(max(inter, inter_s)))
    grid = (rows, triton.cdiv(max(inter, inter_s), block))
    l1_finish_kernel[grid](
        h_part, block_expert, act, n_rows_r, inter, hs_part, act_s, m_s, inter_s, float(beta), float(lin_beta),
        BM=bm, BLOCK=block, SPLIT=split, INTERPRET=interpret, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )
