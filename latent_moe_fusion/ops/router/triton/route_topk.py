"""Triton backend of lmf::noaux_tc_route: sigmoid, bias, top-k, renormalisation and the EP share in one
launch (ops/router/noaux_tc_route.py defines the semantics this reproduces bit for bit on CUDA).

Each program holds ROWS rows of E biased scores in registers. Every score becomes a unique int64 key
(order-preserving int32 of the value, then the reversed column so that ties favour the lower index);
Triton's bitonic top-k keeps the top_k largest keys (rounded up to a power of two, the k-th is the
top_k-th of them). The chosen columns are then placed like torch.topk's gather pass: those above the
k-th value in column order, then the tied ones (pairwise ranks over the top_k). The chosen scores are
summed in slot order in registers and written once, renormalised. H200, M = 1, CUDA graph: 7.0 us with
a store / barrier / reload for the slot-order sum, 5.7 us in registers; the same kernel without the
top-k (wrong ids) 3.3-4.3 us, a bare load + store 4.4 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...common.backends import Backend, Reason, register_backend
from ...common.triton_support import triton_available

MAX_EXPERTS = 4096  # one row of keys in registers
MAX_TOP_K = 64  # the strike-out loop and the slot sums are unrolled
INT64_MIN = tl.constexpr(-(2**63))


@triton.jit
def noaux_tc_route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, m_rows, num_experts, logits_row_stride,
    first_expert, num_local, renorm_eps, scaling_factor,
    TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < m_rows
    valid = row_ok[:, None] & (cols < num_experts)[None, :]
    logit = tl.load(logits_ptr + rows[:, None] * logits_row_stride + cols[None, :], mask=valid, other=0.0)
    score = tl.sigmoid(logit)
    biased = score + tl.load(bias_ptr + cols, mask=cols < num_experts, other=0.0)[None, :]

    bits = biased.to(tl.int32, bitcast=True)
    okey = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order of okey == order of the values
    okey = tl.where(biased != biased, 0x7FFFFFFF, okey)  # NaN is the largest, as in torch.topk
    key = (okey.to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]
    key = tl.where(valid, key, INT64_MIN)
    top = tl.topk(key, TOP_K_POW2, dim=1)  # [ROWS, TOP_K_POW2] keys, descending (bitonic top-k)
    pos = tl.arange(0, TOP_K_POW2)[None, :]
    live = (pos < TOP_K) & row_ok[:, None]
    kth = (tl.max(tl.where(pos == TOP_K - 1, top, INT64_MIN), axis=1) >> 32).to(tl.int32)
    top_okey = (top >> 32).to(tl.int32)
    top_col = BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)

    # torch.topk's gather order: those above the k-th value by column, then the tied ones by column
    above = live & (top_okey > kth[:, None])
    tied = live & (top_okey == kth[:, None])
    before = top_col[:, None, :] < top_col[:, :, None]  # [row, j, i]: column i comes before column j
    rank_above = tl.sum((before & above[:, None, :]).to(tl.int32), axis=2)
    rank_tied = tl.sum((before & tied[:, None, :]).to(tl.int32), axis=2)
    n_above = tl.sum(above.to(tl.int32), axis=1)
    slot = tl.where(above, rank_above, n_above[:, None] + rank_tied)
    local = top_col - first_expert
    local = tl.where((local >= 0) & (local < num_local), local, -1)
    out = rows[:, None] * TOP_K + slot
    tl.store(ids_ptr + out, local, mask=live)
    # the chosen scores again (same input, same instructions: the same bits as above), summed in slot
    # order: each step adds the one score of slot j (a sum of it and zeros, so exact)
    chosen = tl.sigmoid(tl.load(logits_ptr + rows[:, None] * logits_row_stride + top_col, mask=live, other=0.0))
    total = tl.zeros([ROWS], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        total += tl.sum(tl.where(live & (slot == j), chosen, 0.0), axis=1)
    weights = tl.math.div_rn(chosen, (total + renorm_eps)[:, None]) * scaling_factor
    tl.store(weights_ptr + out, weights, mask=live)


def route_launch_shape(m: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_E, rows per program, num_warps). One row per program everywhere: the selection is a chain of
    dependent reductions, so more rows per program only lengthen it. H200, E = 896, top-16, CUDA graph
    (us; rows x warps = 1x1 / 1x4 / 1x8 / 2x8 / 4x8): M = 1: 11.9 / 6.8 / 7.2 / - / -; M = 128: 13.2 /
    8.1 / 6.6 / 9.8 / 15.2; M = 1024: 17.9 / 21.8 / 24.4 / 23.8 / 24.4; M = 4096: 67.4 / 70.1 / 82.5 /
    75.3 / 75.8. Few tokens: many warps shorten each reduction; many: one warp per row fills the SMs."""
    block_e = triton.next_power_of_2(num_experts)
    if m <= 4:
        return block_e, 1, 4
    return block_e, 1, 8 if m <= 256 else 1


def noaux_tc_route_triton(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renorm_eps: float, scaling_factor: float,
    first_expert: int, num_local: int, launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch` = (rows per program, num_warps) overrides route_launch_shape's choice (tests)."""
    m, num_experts = logits.shape
    ids = torch.empty(m, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
    if m == 0:
        return ids, weights
    block_e, rows, num_warps = route_launch_shape(m, num_experts)
    rows, num_warps = launch or (rows, num_warps)
    # TOP_K_POW2 at least 2: tl.topk takes k >= 2 (a top-1 router keeps the first of two)
    noaux_tc_route_kernel[(triton.cdiv(m, rows),)](
        logits, correction_bias, ids, weights, m, num_experts, logits.stride(0),
        first_expert, num_local, float(renorm_eps), float(scaling_factor),
        TOP_K=top_k, TOP_K_POW2=max(2, triton.next_power_of_2(top_k)), BLOCK_E=block_e, ROWS=rows, num_warps=num_warps,
    )
    return ids, weights


def route_size_reason(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, *rest) -> Reason:
    num_experts = logits.shape[1]
    if num_experts > MAX_EXPERTS:
        return f"E = {num_experts} > {MAX_EXPERTS} (one row of scores is held in registers)"
    if top_k > MAX_TOP_K:
        return f"top_k = {top_k} > {MAX_TOP_K} (the selection loop is unrolled)"
    if logits.shape[0] * top_k >= 2**31:
        return f"M * top_k = {logits.shape[0] * top_k} too many for 32-bit output offsets; split the batch"
    return None


register_backend(
    Backend("noaux_tc_route", "triton", 10, ("cuda",), noaux_tc_route_triton, triton_available, route_size_reason)
)
