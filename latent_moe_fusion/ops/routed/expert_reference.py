"""Reference backends of lmf::routed_experts and lmf::moe_shared_producer: pure PyTorch, any device, the semantics of
docs/design.md. Their cross-rank movement is always torch.distributed's (the symmetric-memory path is checked against it)."""

from __future__ import annotations

import torch

from ..common.backends import ANY_DEVICE, Backend, register_backend
from ..common.fragment_layouts import publish_fragments
from ..common.reference_math import rms_norm_math, routed_experts_math, shared_expert_math


def producer_reference(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name,
) -> tuple[torch.Tensor, torch.Tensor]:
    y = routed_experts_math(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta)
    y_n = rms_norm_math(y, rms_weight, eps)
    s_partial = shared_expert_math(x_s, w1_s, w3_s, w2_s, beta, lin_beta)
    return y_n, publish_fragments(s_partial, mode, group_name, symmetric=False)


register_backend(Backend("routed_experts", "reference", 100, ANY_DEVICE, routed_experts_math))
register_backend(Backend("moe_shared_producer", "reference", 100, ANY_DEVICE, producer_reference))
