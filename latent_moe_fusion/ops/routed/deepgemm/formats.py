"""Conversions between this project's tensor formats and the ones DeepGEMM's MegaMoE reads.

Weights. Ours (ops/common/mxfp4.py): packed uint8 [E, N, K/2], byte j = element 2j (low nibble) and
2j+1 (high nibble), code = sign bit 3 | e2m1 magnitude bits 0-2; scales uint8 E8M0 [E, N, K/32].
DeepGEMM's packed FP4 (deep_gemm/utils/math.py `per_token_cast_to_fp4`, csrc/utils/math.hpp
`kPackedFP4 = torch::kInt8`) uses the same nibble order and code, in an int8 tensor: the bytes
are reinterpreted, not converted. Its scales enter `transform_sf_into_required_layout` as float32
powers of two [E, N, K/32] whose exponent field is the E8M0 byte, which we build with a shift.

Activations. MegaMoE reads FP8 e4m3 activations with one UE8M0 scale per 32 along K, four scale
bytes packed little-endian into one int32 ([M, K/128]), the format of DeepGEMM's
`per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)`. That helper
synchronises with the host (an assert on the data); ours is the same arithmetic without a sync,
so it can run inside CUDA-graph capture.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
SF_GRAN_K = 32  # elements per scale
SF_PER_INT = 4  # UE8M0 bytes per packed int32


def mxfp4_weight_as_deepgemm(packed: torch.Tensor) -> torch.Tensor:
    """Our packed uint8 MXFP4 codes as DeepGEMM's int8 packed FP4 (same bytes, no copy)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"mxfp4 weights must be uint8 packed codes, got {packed.dtype}")
    return packed.view(torch.int8)


def e8m0_as_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> float32 whose exponent field is the byte (2**(b-127); byte 0 -> 0.0).

    Byte 0 becomes +0.0 rather than 2**-127: only the exponent bits travel, and DeepGEMM packs
    them back with `bits >> 23`, so the byte the kernel sees is the byte we had.
    """
    if scales.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8, got {scales.dtype}")
    return (scales.to(torch.int32) << 23).view(torch.float32)


def ue8m0_bytes_of(sf: torch.Tensor) -> torch.Tensor:
    """float32 powers of two (or zero) -> their uint8 exponent bytes."""
    return (sf.contiguous().view(torch.int32) >> 23).to(torch.uint8)


def pack_ue8m0(bytes_: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/32] -> int32 [..., K/128], byte i of each int = scale 4j+i (little-endian)."""
    if bytes_.shape[-1] % SF_PER_INT:
        raise ValueError(f"{bytes_.shape[-1]} scales per row is not a multiple of {SF_PER_INT}")
    b = bytes_.to(torch.int32).reshape(*bytes_.shape[:-1], -1, SF_PER_INT)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/128] -> uint8 [..., K/32] (inverse of pack_ue8m0)."""
    parts = [(packed >> (8 * i)) & 0xFF for i in range(SF_PER_INT)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1).to(torch.uint8)


def quantize_fp8_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], packed UE8M0 int32 [M, K/128]); no host synchronisation.

    Per 32-block: scale = amax / 448 rounded up to a power of two (amax floored at 1e-4), byte
    clamped to 1..254, values = x / scale cast to e4m3 (round to nearest even, in range).
    """
    m, k = x.shape
    if k % (SF_GRAN_K * SF_PER_INT):
        raise ValueError(f"K = {k} must be a multiple of {SF_GRAN_K * SF_PER_INT} for packed UE8M0 scales")
    blocks = x.float().reshape(m, k // SF_GRAN_K, SF_GRAN_K)
    amax = blocks.abs().amax(dim=-1).clamp_min(1e-4)
    bits = (amax / FP8_MAX).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up to 2**e
    exponent = exponent.clamp(1, 254)
    scale = (exponent << 23).view(torch.float32)
    values = (blocks * (1.0 / scale).unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(m, k)
    return values, pack_ue8m0(exponent.to(torch.uint8))


def dequantize_fp8_ue8m0(values: torch.Tensor, packed_sf: torch.Tensor) -> torch.Tensor:
    """Inverse of quantize_fp8_ue8m0 (float32), for checks."""
    m, k = values.shape
    scale = e8m0_as_float(unpack_ue8m0(packed_sf))
    return (values.float().reshape(m, k // SF_GRAN_K, SF_GRAN_K) * scale.unsqueeze(-1)).reshape(m, k)
