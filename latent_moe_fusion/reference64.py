"""Float64 forward of one R = 1 KimiK3MoEBlock: the yardstick the demo measures every path against.

Routing is taken from the block's own router on the same input (the top-k choice is part of the
input, not of the arithmetic being measured); everything after it runs in float64 without any
rounding, expert by expert over the experts that received tokens.
"""

from __future__ import annotations

import torch

from .model.block import KimiK3MoEBlock
from .model.router import localize_ids, route
from .ops.common.mxfp4 import dequantize_mxfp4

F64 = torch.float64


def situ64(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))


def routing(block: KimiK3MoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids of this rank's experts, -1 elsewhere; weights) exactly as the block computes them."""
    cfg = block.cfg
    ids, weights = route(x, block.gate_weight, block.correction_bias, cfg.top_k, cfg.routed_scaling_factor,
                         block.router_gemm)
    if block.ep_size > 1:
        ids = localize_ids(ids, block.first_expert, block.num_local_experts)
    return ids, weights


def _expert64(w: torch.Tensor, scale: torch.Tensor | None, expert: int) -> torch.Tensor:
    if scale is not None:
        return dequantize_mxfp4(w[expert], scale[expert], torch.float32).to(F64)
    return w[expert].to(F64)


def shared_weights(block: KimiK3MoEBlock) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w1_s, w3_s, w2_s) of the block's shared expert; merged gate/up as two row-block views."""
    if block.shared_gate_up == "merged":
        inter = block.shared_w13.shape[0] // 2
        return block.shared_w13[:inter], block.shared_w13[inter:], block.shared_w2
    return block.shared_w1, block.shared_w3, block.shared_w2


def block_float64(block: KimiK3MoEBlock, x: torch.Tensor) -> torch.Tensor:
    if block.tp_world != 1:
        raise ValueError("block_float64 computes the R = 1 block; build the block with tp_group=None")
    cfg = block.cfg
    beta, lin_beta = cfg.situ_beta, cfg.situ_linear_beta
    ids, weights = routing(block, x)
    x64 = x.to(F64)
    z = x64 @ block.w_down.to(F64).t()
    y = torch.zeros_like(z)
    inter = cfg.moe_intermediate_size
    for expert in torch.unique(ids[ids >= 0]).tolist():
        rows, slots = torch.nonzero(ids == expert, as_tuple=True)
        h = z[rows] @ _expert64(block.w13, block.w13_scale, expert).t()
        out = situ64(h[:, :inter], h[:, inter:], beta, lin_beta) @ _expert64(block.w2, block.w2_scale, expert).t()
        y.index_add_(0, rows, out * weights[rows, slots].to(F64).unsqueeze(1))
    y_n = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * block.norm_weight.to(F64)
    w1_s, w3_s, w2_s = (w.to(F64) for w in shared_weights(block))
    s = situ64(x64 @ w1_s.t(), x64 @ w3_s.t(), beta, lin_beta) @ w2_s.t()
    return y_n @ block.w_up.to(F64).t() + s
