"""Activations for the FP8 routed kernels (the L1 by default at decode, LMF_ROUTED_FP8): each token's bf16 row split into two e4m3 parts.

z * 2^f = hi + lo with hi = e4m3(z * 2^f) and lo = e4m3(z * 2^f - hi), f a power of two per token that puts its
largest |z| at the top of e4m3's range (448). One e4m3 keeps 4 of a bf16's 8 significant bits, two keep 8 for
values within e4m3's normal range of the row's largest (docs/design/routed-dequantisation.md: the routed L1 product
through the two parts lands ~3e-5 from float64, one part alone 2.7e-2). The kernels multiply their FP32 sums by
col_factor = 2^(6 - f): 2^-f undoes the split's factor, 2^6 the codes' placement as e4m3 (gluon/
routed_fp8.py). Both parts come in the kernels' k order: inside each 32-wide block the even k first, then the odd
k (kappa = 16 * (k % 2) + k // 2).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
KAPPA_BLOCK = 32
MAX_SHIFT = 120  # 2^f and 2^(6 - f) stay normal FP32 numbers for any bf16 row


def to_kappa_order(x: torch.Tensor) -> torch.Tensor:
    """[..., K] in the weight's k order -> the FP8 kernels' order (even k, then odd k, per 32-block)."""
    *lead, k = x.shape
    if k % KAPPA_BLOCK:
        raise ValueError(f"K = {k} must be a multiple of {KAPPA_BLOCK} (the MXFP4 scale block)")
    return x.reshape(*lead, k // KAPPA_BLOCK, KAPPA_BLOCK // 2, 2).transpose(-1, -2).reshape(*lead, k)


def split_e4m3(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """z [T, K] bf16 -> (hi, lo) [T, K] float8_e4m3fn in kappa order and col_factor [T] float32 = 2^(6 - f)."""
    if z.dim() != 2 or z.dtype != torch.bfloat16:
        raise ValueError(f"z must be a [tokens, K] bfloat16 tensor, got {tuple(z.shape)} {z.dtype}")
    zf = z.float()
    amax = zf.abs().amax(dim=1)
    mant, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1)
    # The largest shift with amax * 2^shift <= 448 = 0.875 * 2^9 (an all-zero row: the largest allowed).
    shift = (9 - exp - (mant > E4M3_MAX / 512).to(exp.dtype)).masked_fill(amax == 0, MAX_SHIFT)
    shift = shift.clamp(-MAX_SHIFT, MAX_SHIFT).float()
    x = zf * torch.exp2(shift)[:, None]  # exact: a power of two
    hi = x.to(torch.float8_e4m3fn)
    lo = (x - hi.float()).to(torch.float8_e4m3fn)
    return to_kappa_order(hi), to_kappa_order(lo), torch.exp2(6.0 - shift)
