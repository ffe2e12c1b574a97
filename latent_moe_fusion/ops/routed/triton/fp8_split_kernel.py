"""The per-token e4m3 split of the activations for the FP8 routed kernels (ops/routed/fp8_split.py has the torch form and
the numerics): one program per token row, its largest |z| first, then both parts written in the kernels' k order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8_split import MAX_SHIFT


@triton.jit
def _pow2(f):
    """2^f for integer f in [-126, 127], exact (the exponent field; MUFU's exp2 is approximate)."""
    return ((f + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def split_e4m3_kernel(z_ptr, hi_ptr, lo_ptr, factor_ptr, live_ptr, K, MAX_SHIFT_: tl.constexpr, BLOCK: tl.constexpr,
                      LIVE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if LIVE:  # only rows that hold a pair (L1's act rows: the rest of the blocks is never read back)
        if tl.load(live_ptr + row) < 0:
            return
    k = tl.arange(0, BLOCK)
    live = k < K
    x = tl.load(z_ptr + row * K + k, mask=live, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    # Largest f with amax * 2^f <= 448 = 1.75 * 2^8: amax = m * 2^e, m in [1, 2).
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    f = 8 - e - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    f = tl.minimum(tl.maximum(f, -MAX_SHIFT_), MAX_SHIFT_)
    x = x * _pow2(f)
    hi = x.to(tl.float8e4nv)
    lo = (x - hi.to(tl.float32)).to(tl.float8e4nv)
    kappa = (k // 32) * 32 + (k % 2) * 16 + (k % 32) // 2
    tl.store(hi_ptr + row * K + kappa, hi, mask=live)
    tl.store(lo_ptr + row * K + kappa, lo, mask=live)
    tl.store(factor_ptr + row, _pow2(6 - f))


def launch_split_e4m3(z: torch.Tensor, live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """split_e4m3 (ops/routed/fp8_split.py) on the GPU: (hi, lo) [T, K] float8_e4m3fn in kappa order, col_factor [T].
    live (int32 [T], e.g. a grouping's sorted pairs): rows where it is negative are skipped (left unwritten)."""
    tokens, k = z.shape
    if z.dtype != torch.bfloat16 or k % 32:
        raise ValueError(f"z must be [tokens, K] bfloat16 with K a multiple of 32, got {tuple(z.shape)} {z.dtype}")
    if live is not None and (live.dtype != torch.int32 or live.numel() < tokens):
        raise ValueError(f"live must be int32 with one entry per row of z ({tokens}), got {live.dtype} {live.numel()}")
    hi = torch.empty(tokens, k, dtype=torch.float8_e4m3fn, device=z.device)
    lo = torch.empty_like(hi)
    factor = torch.empty(tokens, dtype=torch.float32, device=z.device)
    split_e4m3_kernel[(tokens,)](z, hi, lo, factor, z if live is None else live, k, MAX_SHIFT_=MAX_SHIFT,
                                BLOCK=triton.next_power_of_2(k), LIVE=live is not None, num_warps=8)
    return hi, lo, factor
