"""Deterministic weights from a seed: every rank builds the same full tensors, then keeps its shard.

Each tensor has its own generator seeded from (seed, name, index), so a rank that holds only
some experts (expert parallelism) or one shard (tensor parallelism) still gets exactly the
values the single-rank model has.
"""

from __future__ import annotations

import zlib

import torch

from ..ops.common.mxfp4 import quantize_mxfp4


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def normal(
    shape: tuple[int, ...], std: float, seed: int, name: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gen = _generator(seed, name, device)
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def expert_weights(
    num_local: int,
    first_expert: int,
    out_features: int,
    in_features: int,
    seed: int,
    name: str,
    weight_format: str,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stacked weights [E_local, N, K] of experts first_expert.., bf16/fp32 or packed mxfp4 + scales."""
    std = in_features**-0.5
    if weight_format == "mxfp4":
        packed = torch.empty(num_local, out_features, in_features // 2, dtype=torch.uint8, device=device)
        scales = torch.empty(num_local, out_features, in_features // 32, dtype=torch.uint8, device=device)
    else:
        packed = torch.empty(num_local, out_features, in_features, dtype=dtype, device=device)
        scales = None
    for local in range(num_local):
        w = normal((out_features, in_features), std, seed, f"{name}.{first_expert + local}", device)
        if weight_format == "mxfp4":
            packed[local], scales[local] = quantize_mxfp4(w)
        else:
            packed[local] = w.to(dtype)
    return packed, scales
