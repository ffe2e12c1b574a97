"""Rows to e4m3 in 1 x 128 blocks with FP32 scales: the W4A8 kernels' activations (ops/routed/w4a8_numerics.py
quantize_activations is the definition; this kernel gives its bits). One program per row; rows whose `live` entry
is negative (a grouping's padding rows) are skipped and left unwritten."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_split import E4M3_MAX
from ..w4a8_numerics import ACT_BLOCK


@triton.jit
def _round_to_e4m3_grid(q):
    """|q| <= 448 rounded to the nearest e4m3 value (ties to even) in FP32, so that the cast is exact: the
    interpreter's FP32 -> e4m3 cast drops a rounding carry into the exponent (triton 3.6)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000
    magnitude = bits & 0x7FFFFFFF
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000  # 3 mantissa bits
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |q| * 2^9 to an integer, ties to even
    a = magnitude.to(tl.float32, bitcast=True)
    subnormal = (((a * 512.0 + magic) - magic) * 0.001953125).to(tl.int32, bitcast=True)  # the grid of 2^-9 steps
    return (tl.where(a < 0.015625, subnormal, normal) | sign).to(tl.float32, bitcast=True)  # -0 stays -0


@triton.jit
def quantize_1x128_kernel(x_ptr, q_ptr, s_ptr, live_ptr, K, E4M3_MAX_: tl.constexpr, BLOCKS: tl.constexpr,
                          LIVE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if LIVE:
        if tl.load(live_ptr + row) < 0:
            return
    b = tl.arange(0, BLOCKS)
    k = b[:, None] * 128 + tl.arange(0, 128)[None, :]
    blocks = K // 128
    live = (b < blocks)[:, None]
    x = tl.load(x_ptr + row * K + k, mask=live, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # IEEE divisions, as the definition's torch ops (Triton's `/` on FP32 is the approximate one).
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX_, tl.float32)), 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -E4M3_MAX_), E4M3_MAX_)
    tl.store(q_ptr + row * K + k, _round_to_e4m3_grid(q).to(tl.float8e4nv), mask=live)
    tl.store(s_ptr + row * blocks + b, scale, mask=b < blocks)


def quantize_1x128(x: torch.Tensor, live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (bf16 or FP32, K a multiple of 128) -> (e4m3 values [R, K], FP32 scales [R, K / 128]);
    live (int32 [>= R], e.g. a grouping's sorted pairs): rows where it is negative are left unwritten."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] % ACT_BLOCK:
        raise ValueError(f"quantize_1x128: x must be [rows, K] bfloat16 or float32 with K a multiple of {ACT_BLOCK}, "
                         f"got {tuple(x.shape)} {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("quantize_1x128: x must be contiguous (rows of K values)")
    rows, k = x.shape
    if live is not None and (live.dtype != torch.int32 or live.numel() < rows or live.device != x.device):
        raise ValueError(f"quantize_1x128: live must be int32 on {x.device} with one entry per row ({rows}), got "
                         f"{live.dtype} {live.numel()} on {live.device}")
    values = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, k // ACT_BLOCK, dtype=torch.float32, device=x.device)
    if rows:
        quantize_1x128_kernel[(rows,)](x, values, scales, x if live is None else live, k, E4M3_MAX_=E4M3_MAX,
                                       BLOCKS=triton.next_power_of_2(k // ACT_BLOCK), LIVE=live is not None,
                                       num_warps=8)
    return values, scales
