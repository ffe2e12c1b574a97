"""lmf::moe_shared_producer: schema, fake (meta) impl, argument checks and dispatch (common/op_library.py says how
the ops are defined)."""

from __future__ import annotations

import torch

from ..common.fragment_layouts import fragment_shape
from ..common.input_checks import check_mode_and_group, check_positive, check_shape, check_tensor
from ..common.op_library import _define
from .backend_dispatch import _run_routed_backend
from .expert_validation import validate_producer_layout, validate_routed, validate_shared


def _validate_producer(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name, ids: bool = True, op: str = "moe_shared_producer",
) -> tuple[int, int, int, int]:
    """Returns (M, H, R, E). op: the op named in errors."""
    num_experts, _ = validate_routed(op, z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format,
                                     beta, lin_beta, ids=ids)
    check_tensor(op, "rms_weight", rms_weight, ndim=1, dtypes=(z.dtype, torch.float32), device=z.device)
    check_shape(op, "rms_weight", rms_weight, (z.shape[1],), "[L] with L = z.shape[1]")
    check_positive(op, "eps", eps)
    hidden = validate_shared(op, x_s, w1_s, w3_s, w2_s, z.dtype, z.device)
    world = check_mode_and_group(op, mode, group_name)
    validate_producer_layout(op, z.shape[0], x_s, mode, world, group_name)
    return z.shape[0], hidden, world, num_experts


def _moe_shared_producer(
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
    rms_weight: torch.Tensor,
    eps: float,
    x_s: torch.Tensor,
    w1_s: torch.Tensor,
    w3_s: torch.Tensor,
    w2_s: torch.Tensor,
    mode: str,
    group_name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_n [M, L], ws): normalised routed output and this rank's shared fragments in `mode`'s layout."""
    args = (z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
            rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name)
    *_, num_experts = _validate_producer(*args, ids=False)
    return _run_routed_backend("moe_shared_producer", topk_ids, num_experts, args)


def _moe_shared_producer_fake(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name=None,
):
    m, hidden, world, _ = _validate_producer(
        z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
        rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name,
    )
    return z.new_empty(z.shape), x_s.new_empty(fragment_shape(mode, m, hidden, world))


moe_shared_producer = _define(
    "moe_shared_producer(Tensor z, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, Tensor? w13_scale, "
    "Tensor? w2_scale, str weight_format, float beta, float lin_beta, Tensor rms_weight, float eps, Tensor x_s, "
    "Tensor w1_s, Tensor w3_s, Tensor w2_s, str mode, str? group_name=None) -> (Tensor, Tensor)",
    _moe_shared_producer, _moe_shared_producer_fake,
)
