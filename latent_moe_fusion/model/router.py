"""Kimi K3 router: sigmoid scores + correction bias, top-k on biased scores (noaux_tc, 1 group)."""

from __future__ import annotations

import torch

from ..ops.common import route_math as _ops_routing
from ..ops.common.route_math import localize as localize_ids  # noqa: F401  (the EP share; lmf::noaux_tc_route folds it in)

ROUTER_GEMMS = ("fp32", "bf16")


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor, gemm: str = "fp32") -> torch.Tensor:
    """FP32 logits [M, E] = x @ gate_weight^T.

    gemm="fp32" (the HF reference): the FP32 GEMM of the widened operands. On CUDA this is an FP32 SIMT
    GEMM plus an FP32 copy of the weight per call: 9.6 us + 35 us at M = 8 and 9.6 + 1030 us at M = 4096
    for one Kimi K3 rank on the H200.
    gemm="bf16" (what serving engines run): on CUDA one BF16 tensor-core GEMM with an FP32 output. Its
    logits are further from float64 than the FP32 GEMM's: relative L2 1.4e-6 at M = 1 and 7.9e-6 at
    M = 4096, against 1.1e-7 and 2.5e-7 (H200, K = 7168), so a near-tie of the top-k can resolve the other
    way. Elsewhere (CPU: torch has no BF16 GEMM with an FP32 output there) it is the FP32 GEMM.
    """
    if gemm not in ROUTER_GEMMS:
        raise ValueError(f"router gemm must be one of {ROUTER_GEMMS}, got {gemm!r}")
    return _ops_routing.router_logits(x, gate_weight, gemm)  # one implementation: lmf::route_and_project's too


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    scaling_factor: float,
    gemm: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (global expert ids [M, K] int32, weights [M, K] fp32 summing to scaling_factor)."""
    return route_from_logits(router_logits(x, gate_weight, gemm), correction_bias, top_k, scaling_factor)


def route_from_logits(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, scaling_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router after its GEMM (what the fusion pass rewrites into lmf::noaux_tc_route)."""
    scores = torch.sigmoid(logits)
    chosen = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=False).indices
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling_factor
    return chosen.to(torch.int32), weights
