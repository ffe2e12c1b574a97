"""What the routed experts compute on FP8 activations (W4A8): the numerics a W4A8 prefill kernel must reproduce.

A W4A8 path runs the routed GEMMs on FP8 (e4m3) MMAs, as DeepGEMM's MegaMoE runs Kimi K3's routed experts on
Blackwell. Hopper's FP8 wgmma has no block scales, so both operands carry theirs outside the MMA and the kernel
promotes each 128-wide K block's FP32 partial sum with them:

- activations: quantised per token in 1 x 128 blocks, scale = the block's largest magnitude / 448 (FP32), values
  rounded to e4m3 (quantize_activations);
- MXFP4 weights: each block of 64 output rows x 128 K (rows from a multiple of 64, K from a multiple of 128) keeps
  the largest of its 256 E8M0 exponents as its scale and holds e2m1 * 2^(s_i - s_max) as e4m3
  (expand_mxfp4_to_e4m3; block_exponents gives the kernels' exponents). That is exact while a block's exponents lie
  within 8 of its largest (e4m3 subnormals reach 2^-9; the smallest e2m1 magnitude is 0.5); farther apart, the
  smaller ones round to nearest. One scale per 64 weight rows lets the kernel promote with one FFMA per accumulator
  element (a thread's sums span 32 weight rows of one block and two tokens).

routed_experts64 computes the op in float64 from exactly these quantised operands (w4a8=True: z per token, the SiTU
activation rounded to bf16 and then quantised per pair row, as the kernels write bf16 activation rows from L1 and
quantise them for L2) or with nothing quantised (w4a8=False): their difference is what W4A8 costs before any
kernel's accumulation order (bench/w4a8_numerics.py measures it at Kimi K3's sizes, docs/numerics.md quotes it). The
kernels (gluon/routed_w4a8.py, LMF_ROUTED_W4A8) compute it with FP32 sums.
"""

from __future__ import annotations

import torch

from ..common.mxfp4 import BLOCK as MXFP4_BLOCK
from ..common.mxfp4 import E8M0_BIAS, E8M0_NAN, dequantize_mxfp4, e2m1_lut, unpack_codes
from .fp8_split import E4M3_MAX

ACT_BLOCK = 128  # activation values per FP32 scale along K (and the weights' promotion block)
WEIGHT_BLOCK_ROWS = 64  # weight rows per e4m3 expansion scale
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
    # Tensor by tensor: an IEEE division on every device (CUDA multiplies by the reciprocal of a Python scalar).
    scales = torch.where(amax > 0, amax / amax.new_tensor(E4M3_MAX), torch.ones_like(amax))
    values = (blocks / scales).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return values.reshape(m, k), scales.squeeze(-1)


def _check_weights(packed: torch.Tensor, scales: torch.Tensor, what: str) -> int:
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{what}: packed and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    k = packed.shape[-1] * 2
    _check_k(k, what)
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * MXFP4_BLOCK != k:
        raise ValueError(f"{what}: scales shape {tuple(scales.shape)} does not match packed "
                         f"{tuple(packed.shape)} (expected [..., K/32] with K = {k})")
    if packed.dim() < 2 or packed.shape[-2] % WEIGHT_BLOCK_ROWS:
        raise ValueError(f"{what}: N = {packed.shape[-2] if packed.dim() > 1 else None} weight rows must be a "
                         f"multiple of {WEIGHT_BLOCK_ROWS} (one e4m3 scale per {WEIGHT_BLOCK_ROWS} x {ACT_BLOCK} block)")
    return k


def block_exponents(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales [..., N, K/32] -> uint8 [..., N/64, K/128]: each 64 x 128 block's largest exponent (255, the NaN
    byte, wins as the largest)."""
    n, kb = scales.shape[-2], scales.shape[-1] * MXFP4_BLOCK // ACT_BLOCK
    per_block = ACT_BLOCK // MXFP4_BLOCK
    blocks = scales.reshape(*scales.shape[:-2], n // WEIGHT_BLOCK_ROWS, WEIGHT_BLOCK_ROWS, kb, per_block)
    return blocks.amax(dim=-1).amax(dim=-2)


def expand_mxfp4_to_e4m3(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (packed [..., N, K/2], E8M0 scales [..., N, K/32]) -> (e4m3 values [..., N, K], FP32 scales
    [..., N/64, K/128]): per 64 x 128 block the largest exponent is the scale, the rest shift into the values."""
    k = _check_weights(packed, scales, "expand_mxfp4_to_e4m3")
    lead, n = packed.shape[:-2], packed.shape[-2]
    per_block = ACT_BLOCK // MXFP4_BLOCK
    top = block_exponents(scales).to(torch.int32)  # [..., N/64, K/128]
    top_rows = top.repeat_interleave(WEIGHT_BLOCK_ROWS, dim=-2).repeat_interleave(per_block, dim=-1)  # per 32-block
    shift = torch.exp2((scales.to(torch.int32) - top_rows).to(torch.float32))  # 2^(s_i - s_max) <= 1
    values = e2m1_lut(packed.device)[unpack_codes(packed).long()]
    values = values.reshape(*lead, n, k // MXFP4_BLOCK, MXFP4_BLOCK) * shift.unsqueeze(-1)
    block_scales = torch.exp2(top.to(torch.float32) - E8M0_BIAS).masked_fill(top == E8M0_NAN, float("nan"))
    return values.reshape(*lead, n, k).to(torch.float8_e4m3fn), block_scales


def blockwise_matmul64(a: torch.Tensor, a_scales: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """float64 [M, N] = sum over 128-wide K blocks of (a_block @ w_block^T) * a_scale * w_scale (w_scales
    [N/64, K/128]): what a kernel's FP8 MMAs with per-block promotion compute, with exact sums."""
    m, k = a.shape
    n = w.shape[0]
    a_blocks = a.to(F64).reshape(m, k // ACT_BLOCK, ACT_BLOCK) * a_scales.to(F64).unsqueeze(-1)
    w_rows = w_scales.to(F64).repeat_interleave(WEIGHT_BLOCK_ROWS, dim=0)  # [N, K/128]
    w_blocks = w.to(F64).reshape(n, k // ACT_BLOCK, ACT_BLOCK) * w_rows.unsqueeze(-1)
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
            act = act.to(torch.bfloat16)  # the kernels' L1 writes bf16 activation rows
            out = blockwise_matmul64(*quantize_activations(act), *expand_mxfp4_to_e4m3(w2[expert], w2_scale[expert]))
        else:
            out = act @ _mxfp4_64(w2[expert], w2_scale[expert]).t()
        y.index_add_(0, rows, out * topk_weights[rows, slots].to(F64).unsqueeze(1))
    return y


def _mxfp4_64(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return dequantize_mxfp4(packed, scales, F64)
