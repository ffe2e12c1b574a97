"""Kimi K3 router: sigmoid scores + correction bias, top-k on biased scores (noaux_tc, 1 group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (global expert ids [M, K] int32, weights [M, K] fp32 summing to scaling_factor)."""
    scores = torch.sigmoid(F.linear(x.float(), gate_weight.float()))
    chosen = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=False).indices
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling_factor
    return chosen.to(torch.int32), weights


def localize_ids(ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global ids -> ids of this rank's experts; experts held elsewhere become -1."""
    local = ids - first_expert
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))
