"""Launches of the staged kernels (routed_staged.py) and their warp-specialised form (routed_staged_ws.py) on the
128-row prefill blocks: the staged_kernel overrides "staged" and "ws" (the default, the kappa kernels, launches from
routed/kappa_path.py). launch_routed_l1 / _l2 (this package's __init__) call these for 128-row blocks.
"""

from __future__ import annotations

import torch

from ...common.device_capability import sm_count
from ...common.mxfp4 import BLOCK as MXFP4_BLOCK
from . import (
    STAGED_BLOCK_ROWS,
    STAGED_MAX_REGISTERS,
    STAGED_STEP_K,
    STAGED_WARPS,
    activation_rows_descriptor,
    step_descriptor,
)


def _staged_descriptor(words: torch.Tensor, gated: bool):
    """The staged kernels' step_descriptor: 128 weight rows (L1: 64 gate + 64 up), 64-wide k steps."""
    return step_descriptor(words, gated, 16 * STAGED_WARPS, STAGED_STEP_K)


# The warp-specialised kernels' ring stages, dequantiser warps and their registers (L1, L2).
WS_STAGES = (4, 4)
WS_DEQUANT_WARPS = (4, 4)
WS_DEQUANT_REGS = (152, 152)


def _launch_ws_l1(
    z: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, act: torch.Tensor, num_blocks: int, top_k: int, beta: float, lin_beta: float,
) -> None:
    from .routed_staged_ws import l1_ws_kernel

    latent, inter = z.shape[1], w13.shape[1] // 2
    num_tiles = num_blocks * (inter // (8 * STAGED_WARPS))
    l1_ws_kernel[(min(num_tiles, sm_count(z.device)),)](
        z, w13_scale, sorted_pairs, block_expert, act, inter, latent, latent // MXFP4_BLOCK, top_k,
        w13_scale.stride(0), float(beta), float(lin_beta), num_tiles,
        _staged_descriptor(w13.view(torch.int32), gated=True), STAGES=WS_STAGES[0], DEQUANT_WARPS=WS_DEQUANT_WARPS[0],
        DEQUANT_REGS=WS_DEQUANT_REGS[0], num_warps=STAGED_WARPS,
    )


def _launch_ws_l2(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, pairs: torch.Tensor, num_blocks: int,
) -> None:
    from .routed_staged_ws import l2_ws_kernel

    latent, inter = w2.shape[1], act.shape[1]
    num_tiles = num_blocks * (latent // (16 * STAGED_WARPS))
    a_desc = activation_rows_descriptor(act[: num_blocks * STAGED_BLOCK_ROWS], STAGED_STEP_K)
    l2_ws_kernel[(min(num_tiles, sm_count(act.device)),)](
        w2_scale, sorted_pairs, block_expert, pairs, latent, inter, inter // MXFP4_BLOCK, w2_scale.stride(0),
        num_tiles, _staged_descriptor(w2.view(torch.int32), gated=False), a_desc, STAGES=WS_STAGES[1],
        DEQUANT_WARPS=WS_DEQUANT_WARPS[1], DEQUANT_REGS=WS_DEQUANT_REGS[1], num_warps=STAGED_WARPS,
    )


def _check_staged_kernel(kernel: str) -> None:
    """The launchers here run the staged kernels and their warp-specialised form; the kappa kernels write act in
    their own column order, so their L1 and L2 launch as a pair from routed/kappa_path.py."""
    if kernel not in ("staged", "ws"):
        raise ValueError(f"the {STAGED_BLOCK_ROWS}-row launchers here run staged_kernel 'staged' or 'ws', got "
                         f"{kernel!r}: the kappa kernels launch as a pair from kappa_path.launch_l1_kappa / "
                         "launch_l2_kappa (expert_schedule.launch_plan does so); pass staged='staged' or 'ws'")


def launch_staged_l1(
    z: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, act: torch.Tensor, num_blocks: int, top_k: int, beta: float, lin_beta: float,
    kernel: str,
) -> None:
    _check_staged_kernel(kernel)
    if kernel == "ws":
        _launch_ws_l1(z, w13, w13_scale, sorted_pairs, block_expert, act, num_blocks, top_k, beta, lin_beta)
        return
    from .routed_staged import l1_staged_kernel

    latent, inter = z.shape[1], w13.shape[1] // 2
    grid = (num_blocks * (inter // (8 * STAGED_WARPS)),)
    l1_staged_kernel[grid](
        z, w13_scale, sorted_pairs, block_expert, act, inter, latent, latent // MXFP4_BLOCK, top_k,
        w13_scale.stride(0), float(beta), float(lin_beta), _staged_descriptor(w13.view(torch.int32), gated=True),
        BM=STAGED_BLOCK_ROWS, num_warps=STAGED_WARPS, maxnreg=STAGED_MAX_REGISTERS,
    )


def launch_staged_l2(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, pairs: torch.Tensor, num_blocks: int, kernel: str,
) -> None:
    _check_staged_kernel(kernel)
    if kernel == "ws":
        _launch_ws_l2(act, w2, w2_scale, sorted_pairs, block_expert, pairs, num_blocks)
        return
    from .routed_staged import l2_staged_kernel

    latent, inter = w2.shape[1], act.shape[1]
    grid = (num_blocks * (latent // (16 * STAGED_WARPS)),)
    l2_staged_kernel[grid](
        act, w2_scale, sorted_pairs, block_expert, pairs, latent, inter, inter // MXFP4_BLOCK, w2_scale.stride(0),
        _staged_descriptor(w2.view(torch.int32), gated=False), BM=STAGED_BLOCK_ROWS, num_warps=STAGED_WARPS,
        maxnreg=STAGED_MAX_REGISTERS,
    )
