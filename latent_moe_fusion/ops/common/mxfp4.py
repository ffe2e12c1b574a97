"""MXFP4 (OCP microscaling): e2m1 codes packed two per byte, one E8M0 scale per 32 along K.

Layout used everywhere in this project, for a weight W [..., N, K]:
  packed  uint8 [..., N, K // 2]   byte j holds element 2j in its low nibble, 2j+1 in its high one
  scales  uint8 [..., N, K // 32]  E8M0: the block's scale is 2 ** (byte - 127); 255 is NaN (OCP MX spec)
quantize_mxfp4 never writes 255; dequantize_mxfp4 turns a block with scale 255 into NaNs rather than
reading the bytes on the host (that would be a sync on the GPU).
A code is sign(bit 3) | e2m1 magnitude(bits 0-2) with magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_MAX = 6.0
# Magnitudes of the 8 non-negative e2m1 codes, indexed by code & 7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Largest e2m1 exponent: 6 = 1.5 * 2**2, so a block's scale is floor(log2(amax)) - 2.
E2M1_EMAX = 2


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: value of every 4-bit code (negative zero included)."""
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def _check_k(k: int, what: str) -> None:
    if k % BLOCK:
        raise ValueError(f"{what}: K = {k} is not divisible by {BLOCK}; MXFP4 needs whole 32-blocks")


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float weights [..., N, K] to (packed uint8 [..., N, K/2], scales uint8 [..., N, K/32]).

    Scale per block: 2 ** (floor(log2(amax)) - 2); codes round to nearest (ties to even code),
    saturating at 6. Values already of the form e2m1 * 2**s round-trip exactly.
    """
    if not w.is_floating_point():
        raise TypeError(f"quantize_mxfp4: w must be a floating tensor, got {w.dtype}")
    _check_k(w.shape[-1], "quantize_mxfp4")
    wf = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = wf.abs().amax(dim=-1, keepdim=True)
    # All-zero blocks take the smallest scale (any scale dequantizes them to zero).
    exp = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny))), -127.0
    )
    scale_exp = (exp - E2M1_EMAX).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = wf / torch.exp2(scale_exp)
    mag = scaled.abs().clamp_max(E2M1_MAX)
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    # Nearest representable magnitude; ties go to the even code (lower index when codes tie evenly).
    dist = (mag.unsqueeze(-1) - values).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    code_idx = torch.arange(8, device=w.device)
    # Prefer even codes among ties, then the smaller one.
    rank = torch.where(candidates, (code_idx % 2) * 8 + code_idx, torch.full_like(code_idx, 99))
    mag_code = rank.argmin(dim=-1)
    sign = (scaled < 0) & (mag_code > 0)
    codes = (mag_code | (sign.to(torch.int64) << 3)).to(torch.uint8)
    codes = codes.reshape(*w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (scale_exp + E8M0_BIAS).to(torch.uint8).squeeze(-1)
    return packed.contiguous(), scales.contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequantize_mxfp4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(packed [..., N, K/2], scales [..., N, K/32]) -> weights [..., N, K] in `dtype`."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(
            f"dequantize_mxfp4: packed and scales must be uint8, got {packed.dtype} and {scales.dtype}"
        )
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != k:
        raise ValueError(
            f"dequantize_mxfp4: scales shape {tuple(scales.shape)} does not match packed "
            f"{tuple(packed.shape)} (expected [..., K/32] with K = {k})"
        )
    codes = unpack_codes(packed).long()
    values = e2m1_lut(packed.device)[codes]
    block_scales = torch.exp2(scales.float() - E8M0_BIAS)
    block_scales = block_scales.masked_fill(scales == E8M0_NAN, float("nan"))
    values = values.reshape(*packed.shape[:-1], k // BLOCK, BLOCK) * block_scales.unsqueeze(-1)
    return values.reshape(*packed.shape[:-1], k).to(dtype)
