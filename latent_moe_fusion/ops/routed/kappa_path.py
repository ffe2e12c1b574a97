"""The launches of the kappa kernels, the default on the 128-row prefill blocks (routed plan: staged_kernel "kappa",
or "kappa_plain": the same kernels without the MMA tiers by valid rows).

L1's activations are first gathered into block rows with each 128-wide column chunk in kappa order
(triton/kappa_columns.py), then L1 (gluon/routed_kappa.py) reads them by TMA and writes act in the same column order,
which L2 reads by TMA as it is. act is the op's own buffer: nothing else reads it in that order, so L1 and L2 must both
run here (expert_schedule.launch_plan takes both from the plan's one staged_kernel).
"""

from __future__ import annotations

import torch

from ..common.mxfp4 import BLOCK as MXFP4_BLOCK
from .gluon import KAPPA_KERNELS, STAGED_BLOCK_ROWS, STAGED_MAX_REGISTERS, STAGED_WARPS, activation_rows_descriptor
from .triton.kappa_columns import KAPPA_CHUNK  # the TMA box's columns: one kappa chunk a k step


def _check_blocks(what: str, act: torch.Tensor, act_cols: int, sorted_pairs: torch.Tensor,
                  block_expert: torch.Tensor, num_blocks: int) -> None:
    """The sizes the kernels address without bounds: a short tensor would be read as zeros by TMA or written past."""
    rows = num_blocks * STAGED_BLOCK_ROWS
    if not act.is_contiguous() or act.dim() != 2 or act.shape[0] < rows or act.shape[1] != act_cols:
        raise ValueError(f"{what}: act must be a contiguous [>= {rows}, {act_cols}] buffer for {num_blocks} blocks "
                         f"of {STAGED_BLOCK_ROWS} rows, got {tuple(act.shape)} (contiguous={act.is_contiguous()})")
    if sorted_pairs.numel() < rows or block_expert.numel() < num_blocks:
        raise ValueError(f"{what}: {num_blocks} blocks need {rows} sorted pairs and {num_blocks} block experts, got "
                         f"{sorted_pairs.numel()} and {block_expert.numel()} (the grouping's outputs for these blocks)")


def _tiers(kernel: str) -> bool:
    """The kernels' TIERS constexpr for staged_kernel `kernel`: the MMA's N by valid rows in tiers, or 64 / 128."""
    if kernel not in KAPPA_KERNELS:
        raise ValueError(f"the kappa launchers run staged_kernel {' or '.join(map(repr, KAPPA_KERNELS))}, got "
                         f"{kernel!r}")
    return kernel == "kappa"


def launch_l1_kappa(
    z: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, act: torch.Tensor, num_blocks: int, top_k: int, beta: float, lin_beta: float,
    kernel: str = "kappa",
) -> None:
    """act[block rows, kappa columns] = bf16(SiTU(gate, up)) of every used 128-row block."""
    from .gluon.routed_kappa import l1_kappa_kernel
    from .triton.kappa_columns import gather_kappa_rows

    latent, inter = z.shape[1], w13.shape[1] // 2
    _check_blocks("kappa L1", act, inter, sorted_pairs, block_expert, num_blocks)
    words = w13.view(torch.int32)
    z_rows = gather_kappa_rows(z.contiguous(), sorted_pairs, block_expert[:num_blocks], STAGED_BLOCK_ROWS, top_k)
    grid = (num_blocks * (inter // (8 * STAGED_WARPS)),)
    l1_kappa_kernel[grid](
        words, w13_scale, sorted_pairs, block_expert, act, inter, latent, latent // 8, latent // MXFP4_BLOCK,
        words.stride(0), w13_scale.stride(0), float(beta), float(lin_beta),
        activation_rows_descriptor(z_rows, KAPPA_CHUNK),
        BM=STAGED_BLOCK_ROWS, num_warps=STAGED_WARPS, maxnreg=STAGED_MAX_REGISTERS,
        TIERS=_tiers(kernel),
    )


def launch_l2_kappa(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, pairs: torch.Tensor, num_blocks: int, kernel: str = "kappa",
) -> None:
    """pairs[pair, :] = act[row] @ W2[e]^T in FP32 for every valid row, act in kappa column order (launch_l1_kappa)."""
    from .gluon.routed_kappa import l2_kappa_kernel

    latent, inter = w2.shape[1], w2.shape[2] * 2
    _check_blocks("kappa L2", act, inter, sorted_pairs, block_expert, num_blocks)
    words = w2.view(torch.int32)
    grid = (num_blocks * (latent // (16 * STAGED_WARPS)),)
    l2_kappa_kernel[grid](
        words, w2_scale, sorted_pairs, block_expert, pairs, latent, inter, inter // 8, inter // MXFP4_BLOCK,
        words.stride(0), w2_scale.stride(0),
        activation_rows_descriptor(act[: num_blocks * STAGED_BLOCK_ROWS], KAPPA_CHUNK),
        BM=STAGED_BLOCK_ROWS, num_warps=STAGED_WARPS, maxnreg=STAGED_MAX_REGISTERS,
        TIERS=_tiers(kernel),
    )
