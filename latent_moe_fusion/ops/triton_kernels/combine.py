"""Top-k combine (FP32, slots summed in order j = 0..K-1, rounded once) with the RMSNorm fused in.

One program per token row: the K slot rows [L] of FP32 expert outputs are weighted and summed in
slot order (no atomics: the result is bitwise the same on every run), rounded to the activation
dtype (y), then, with NORM, y_n = round(float(y) * rsqrt(mean(float(y)^2) + eps) * w) in FP32.
Slots with ids < 0 read nothing. The slot loop is unrolled so all K row loads are in flight at once.
With L2 split along K (SPLIT slices, pairs [SPLIT, M * K, L]) each slot's row is first the sum of
its slices in slice order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .numerics import round_to
from .producer_config import interpreting


@triton.jit
def combine_kernel(
    pairs_ptr, ids_ptr, weights_ptr, out_ptr, rms_ptr, eps, latent, slice_stride,
    TOP_K: tl.constexpr, BLOCK_L: tl.constexpr, NORM: tl.constexpr, INTERPRET: tl.constexpr, SPLIT: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_L)
    cmask = cols < latent
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + m * TOP_K + j)
        w = tl.load(weights_ptr + m * TOP_K + j)
        hit = expert >= 0
        row = tl.load(pairs_ptr + (m * TOP_K + j) * latent + cols, mask=cmask & hit, other=0.0)
        for s in tl.static_range(1, SPLIT):
            row += tl.load(pairs_ptr + s * slice_stride + (m * TOP_K + j) * latent + cols, mask=cmask & hit, other=0.0)
        acc += tl.where(hit, w, 0.0) * row
    dtype = out_ptr.dtype.element_ty
    y = round_to(acc, dtype, INTERPRET)
    if NORM:
        yf = y.to(tl.float32)
        mean_sq = tl.sum(yf * yf, axis=0) / latent
        inv = 1.0 / tl.sqrt_rn(mean_sq + eps)
        rms_w = tl.load(rms_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = round_to(yf * inv * rms_w, dtype, INTERPRET)
    tl.store(out_ptr + m * latent + cols, y, mask=cmask)


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
    block_l = triton.next_power_of_2(latent)
    norm = rms_weight is not None
    combine_kernel[(m,)](
        pairs, topk_ids, topk_weights, out, rms_weight if norm else out, float(eps), latent, pairs.stride(0) if split > 1 else 0,
        TOP_K=top_k, BLOCK_L=block_l, NORM=norm, INTERPRET=interpreting(), SPLIT=split,
        num_warps=8 if block_l >= 2048 else 4,
    )
