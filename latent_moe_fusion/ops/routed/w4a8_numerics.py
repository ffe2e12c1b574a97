"""What the routed experts compute on FP8 activations (W4A8): the numerics a W4A8 prefill kernel must reproduce.

A W4A8 path runs the routed GEMMs on FP8 (e4m3) MMAs, as DeepGEMM's MegaMoE runs Kimi K3's routed experts on
Blackwell. Hopper's FP8 wgmma has no block scales, so both operands carry theirs outside the MMA and the kernel
promotes each 128-wide K block's FP32 partial sum with them:

- activations: quantised per token in 1 x 128 blocks, scale = the block's largest magnitude / 448 (FP32), values
  rounded to e4m3 (quantize_activations);
- MXFP4 weights: each 128-wide K block keeps the largest of its four E8M0 exponents as its scale and holds
  e2m1 * 2^(s_i - s_max) as e4m3 (expand_mxfp4_to_e4m3). That is exact while a block's exponents lie within 8 of
  each other (e4m3 subnormals reach 2^-9; the smallest e2m1 magnitude is 0.5); farther apart, the smaller ones round.

routed_experts64 computes the op in float64 from exactly these quantised operands (w4a8=True; the SiTU activation is
quantised from FP32, as a kernel that writes e4m3 activations from its L1 epilogue would) or with nothing quantised
(w4a8=False): their difference is what W4A8 costs before any kernel's accumulation order
(bench/w4a8_numerics.py measures it at Kimi K3's sizes, docs/numerics.md quotes it). No kernel runs this path yet.
"""

from __future__ import annotations

import torch

from ..common.mxfp4 import BLOCK as MXFP4_BLOCK
from ..common.mxfp4 import E8M0_BIAS, E8M0_NAN, dequantize_mxfp4, e2m1_lut, unpack_codes
from .fp8_split import E4M3_MAX

ACT_BLOCK = 128  # activation values per FP32 scale along K (and the weights' promotion block)
F64 = torch.float64


def _check_k(k: int, what: str) -> None:
    if k % ACT_BLOCK:
        raise ValueError(f"{what}: K = {k} must be a multiple of {ACT_BLOCK} (one FP32 scale per 1 x {ACT_BLOCK} "
                         "block); the W4A8 path does not take other K")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 values [M, K], FP32 scales [M, K / 128]) with x ~ values * scale per 1 x 128 block. An
    all-zero block gets scale 1 (its values are zero)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activations: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    _check_k(k, "quantize_activations")
    blocks = x.to(torch.float32).reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = (blocks / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(m, k), scales.squeeze(-1)


def expand_mxfp4_to_e4m3(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (packed [..., N, K/2], E8M0 scales [..., N, K/32]) -> (e4m3 values [..., N, K], FP32 scales
    [..., N, K/128]): per 128-wide K block the largest exponent is the scale, the rest shift into the values."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"expand_mxfp4_to_e4m3: packed and scales must be uint8, got {packed.dtype} and "
                        f"{scales.dtype}")
    k = packed.shape[-1] * 2
    _check_k(k, "expand_mxfp4_to_e4m3")
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * MXFP4_BLOCK != k:
        raise ValueError(f"expand_mxfp4_to_e4m3: scales shape {tuple(scales.shape)} does not match packed "
                         f"{tuple(packed.shape)} (expected [..., K/32] with K = {k})")
    lead = packed.shape[:-1]
    per_block = ACT_BLOCK // MXFP4_BLOCK
    exps = scales.to(torch.int32).reshape(*lead, k // ACT_BLOCK, per_block)
    top = exps.amax(dim=-1, keepdim=True)
    shift = torch.exp2((exps - top).to(torch.float32))  # 2^(s_i - s_max) <= 1
    values = e2m1_lut(packed.device)[unpack_codes(packed).long()]
    values = values.reshape(*lead, k // ACT_BLOCK, per_block, MXFP4_BLOCK) * shift.unsqueeze(-1)
    block_scales = torch.exp2(top.squeeze(-1).to(torch.float32) - E8M0_BIAS)
    block_scales = block_scales.masked_fill((exps == E8M0_NAN).any(dim=-1), float("nan"))
    return values.reshape(*lead, k).to(torch.float8_e4m3fn), block_scales


def blockwise_matmul64(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] = sum over 128-wide K blocks of (a_block @ w_block^T) * a_scale * w_scale: what a kernel's
    FP8 MMAs with per-block promotion compute, with exact sums."""
    m, k = a.shape
    n = w.shape[0]
    a_blocks = a.to(F64).reshape(m, k // ACT_BLOCK, ACT_BLOCK) * a_scales.to(F64).unsqueeze(-1)
    w_blocks = w.to(F64).reshape(n, k // ACT_BLOCK, ACT_BLOCK) * w_scales.to(F64).unsqueeze(-1)
    return a_blocks.reshape(m, k) @ w_blocks.reshape(n, k).t()


def routed_experts64(
    z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: torch.Tensor, w2_scale: torch.Tensor, beta: float, lin_beta: float, w4a8: bool,
) -> torch.Tensor:
    """y [M, L] float64 of lmf::routed_experts over MXFP4 weights: exact (w4a8=False), or from the W4A8 path's
    quantised operands (w4a8=True: z per token, the SiTU activation per pair row, weights expanded to e4m3)."""
    m, latent = z.shape
    inter = w2.shape[-1] * 2
    _check_k(latent, "routed_experts64 (L)")
    _check_k(inter, "routed_experts64 (I)")
    y = torch.zeros(m, latent, dtype=F64, device=z.device)
    zq = quantize_activations(z) if w4a8 else None
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        rows, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        if w4a8:
            h = blockwise_matmul64(zq[0][rows], zq[1][rows], *expand_mxfp4_to_e4m3(w13[expert], w13_scale[expert]))
            g, u = h[:, :inter].to(torch.float32), h[:, inter:].to(torch.float32)  # the FP32 accumulator
        else:
            h = z[rows].to(F64) @ _mxfp4_64(w13[expert], w13_scale[expert]).t()
            g, u = h[:, :inter], h[:, inter:]
        act = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))
        if w4a8:
            out = blockwise_matmul64(*quantize_activations(act), *expand_mxfp4_to_e4m3(w2[expert], w2_scale[expert]))
        else:
            out = act @ _mxfp4_64(w2[expert], w2_scale[expert]).t()
        y.index_add_(0, rows, out * topk_weights[rows, slots].to(F64).unsqueeze(1))
    return y


def _mxfp4_64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(packed, scales, F64)
