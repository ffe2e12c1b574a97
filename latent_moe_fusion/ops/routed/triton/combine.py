"""Top-k combine (FP32, slots summed in order j = 0..K-1, rounded once) with the RMSNorm fused in.

One program per token row: the K slot rows [L] of FP32 expert outputs are weighted and summed in
slot order (no atomics: the result is bitwise the same on every run), rounded to the activation
dtype (y), then, with NORM, y_n = round(float(y) * rsqrt(mean(float(y)^2) + eps) * w) in FP32.
Slots with ids < 0 read nothing. The slot loop is unrolled so all K row loads are in flight at once.
With L2 split along K (SPLIT slices, pairs [SPLIT, M * K, L]) each slot's row is first the sum of
its slices in slice order. With the norm and from 3 slices on, the row is processed in column chunks:
K x SPLIT whole rows in flight next to the norm's row spill registers (producer at M = 1 and 4 slices:
113.6 us, 76.4 with chunks; docs/design/routed-decode.md). The norm then reads the
rounded y back in a second pass, so y is bitwise the same and y_n may differ from the one-pass sum of
squares in its last place. Without the norm the one-pass form stays (5.5 us at 4 slices, 14.5 in chunks:
the chunk loop waits for each chunk's loads).

One program per row also at M = 1: cutting a row into column programs (per-chunk sums of squares, the
last to arrive normalising the row) took 6.2 us against 3.8 on the H200 (docs/design/decode-schedule.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...common.gdc import release_dependents
from ...common.pdl import use_pdl
from ...common.triton_numerics import round_to
from ..producer_config import interpreting


@triton.jit
def _slot_sum(pairs_ptr, ids_ptr, weights_ptr, m, cols, cmask, latent, slice_stride, TOP_K: tl.constexpr,
              SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + m * TOP_K + j)
        w = tl.load(weights_ptr + m * TOP_K + j)
        hit = expert >= 0
        row = tl.load(pairs_ptr + (m * TOP_K + j) * latent + cols, mask=cmask & hit, other=0.0)
        for s in tl.static_range(1, SPLIT):
            row += tl.load(pairs_ptr + s * slice_stride + (m * TOP_K + j) * latent + cols, mask=cmask & hit, other=0.0)
        acc += tl.where(hit, w, 0.0) * row
    return acc


@triton.jit
def _combine_chunked(pairs_ptr, ids_ptr, weights_ptr, out_ptr, rms_ptr, eps, latent, slice_stride, m,
                     TOP_K: tl.constexpr, BLOCK_L: tl.constexpr, CHUNK: tl.constexpr, NORM: tl.constexpr,
                     INTERPRET: tl.constexpr, SPLIT: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    sum_sq = 0.0
    # runtime loops over the chunks: unrolled, 16 slots x SPLIT loads x chunks took minutes to compile
    for c in range(0, BLOCK_L // CHUNK):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        cmask = cols < latent
        y = round_to(_slot_sum(pairs_ptr, ids_ptr, weights_ptr, m, cols, cmask, latent, slice_stride, TOP_K, SPLIT,
                               CHUNK), dtype, INTERPRET)
        if NORM:
            yf = y.to(tl.float32)
            sum_sq += tl.sum(yf * yf, axis=0)
        tl.store(out_ptr + m * latent + cols, y, mask=cmask)
    if NORM:
        # y is re-read by the threads that stored it (same layout): program order makes it visible
        inv = 1.0 / tl.sqrt_rn(sum_sq / latent + eps)
        for c in range(0, BLOCK_L // CHUNK):
            cols = c * CHUNK + tl.arange(0, CHUNK)
            cmask = cols < latent
            yf = tl.load(out_ptr + m * latent + cols, mask=cmask, other=0.0).to(tl.float32)
            rms_w = tl.load(rms_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + m * latent + cols, round_to(yf * inv * rms_w, dtype, INTERPRET), mask=cmask)


@triton.jit
def combine_kernel(
    pairs_ptr, ids_ptr, weights_ptr, out_ptr, rms_ptr, eps, latent, slice_stride,
    TOP_K: tl.constexpr, BLOCK_L: tl.constexpr, NORM: tl.constexpr, INTERPRET: tl.constexpr, SPLIT: tl.constexpr,
    CHUNK: tl.constexpr, SIGNAL: tl.constexpr = False,
):
    if SIGNAL:  # a dependent tail may start streaming its weights now (it waits for this kernel's end)
        release_dependents()
    m = tl.program_id(0).to(tl.int64)
    if NORM and SPLIT > 2:
        _combine_chunked(pairs_ptr, ids_ptr, weights_ptr, out_ptr, rms_ptr, eps, latent, slice_stride, m,
                         TOP_K, BLOCK_L, CHUNK, NORM, INTERPRET, SPLIT)
        return
    cols = tl.arange(0, BLOCK_L)
    cmask = cols < latent
    acc = _slot_sum(pairs_ptr, ids_ptr, weights_ptr, m, cols, cmask, latent, slice_stride, TOP_K, SPLIT, BLOCK_L)
    dtype = out_ptr.dtype.element_ty
    y = round_to(acc, dtype, INTERPRET)
    if NORM:
        yf = y.to(tl.float32)
        mean_sq = tl.sum(yf * yf, axis=0) / latent
        inv = 1.0 / tl.sqrt_rn(mean_sq + eps)
        rms_w = tl.load(rms_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = round_to(yf * inv * rms_w, dtype, INTERPRET)
    tl.store(out_ptr + m * latent + cols, y, mask=cmask)


def combine_tiles(latent: int, top_k: int, split: int) -> tuple[int, int, int]:
    """(row block, column chunk, warps). The chunk (with the norm, from 3 slices on) keeps the top_k x split row
    loads in flight within ~64 floats per thread, at least one per thread."""
    block_l = triton.next_power_of_2(latent)
    num_warps = 8 if block_l >= 2048 else 4
    threads = 32 * num_warps
    chunk = min(block_l, max(threads, triton.next_power_of_2(64 * threads // (top_k * split) + 1) // 2))
    return block_l, chunk, num_warps


def launch_combine(
    pairs: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
    rms_weight: torch.Tensor | None, eps: float,
) -> None:
    """pairs: [M * K, L] FP32, or [SPLIT, M * K, L] slices of a split-K L2."""
    m, top_k = topk_ids.shape
    split = pairs.shape[0] if pairs.dim() == 3 else 1
    latent = out.shape[1]
    if m == 0:
        return
    norm = rms_weight is not None
    signal = use_pdl("tail", out.device)
    block_l, chunk, num_warps = combine_tiles(latent, top_k, split)
    combine_kernel[(m,)](
        pairs, topk_ids, topk_weights, out, rms_weight if norm else out, float(eps), latent, pairs.stride(0) if split > 1 else 0,
        TOP_K=top_k, BLOCK_L=block_l, NORM=norm, INTERPRET=interpreting(), SPLIT=split, CHUNK=chunk,
        SIGNAL=signal, num_warps=num_warps,
    )
