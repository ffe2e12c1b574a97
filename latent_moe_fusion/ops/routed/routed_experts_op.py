"""lmf::routed_experts: schema, fake (meta) impl and dispatch (common/op_library.py says how the ops are defined)."""

from __future__ import annotations

import torch

from ..common.op_library import _define
from .backend_dispatch import _run_routed_backend
from .expert_validation import validate_routed


def _routed_experts(
    z: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    weight_format: str,
    beta: float,
    lin_beta: float,
) -> torch.Tensor:
    """Routed experts in the latent space: y [M, L] in z.dtype (docs/design.md, section 2)."""
    args = (z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta)
    num_experts, _ = validate_routed("routed_experts", *args, ids=False)
    return _run_routed_backend("routed_experts", topk_ids, num_experts, args)


def _routed_experts_fake(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta):
    validate_routed("routed_experts", z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta)
    return z.new_empty(z.shape)


routed_experts = _define(
    "routed_experts(Tensor z, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, Tensor? w13_scale, "
    "Tensor? w2_scale, str weight_format, float beta, float lin_beta) -> Tensor",
    _routed_experts, _routed_experts_fake,
)
