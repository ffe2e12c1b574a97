"""lmf::latent_tail: schema, fake (meta) impl and dispatch (common/op_library.py says how the ops are defined)."""

from __future__ import annotations

import torch

from ..common.backends import select_backend
from ..common.op_library import _define
from .tail_validation import validate_tail


def _latent_tail(
    y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str, group_name: str | None = None
) -> torch.Tensor:
    """out [M, H] = round(fp32(y_n @ w_up^T) + sum_r fp32(fragment r)); hidden_scatter all-gathers."""
    validate_tail("latent_tail", y_n, w_up, ws, mode, group_name)
    return select_backend("latent_tail", y_n.device.type, y_n, w_up, ws, mode, group_name).fn(
        y_n, w_up, ws, mode, group_name
    )


def _latent_tail_fake(y_n, w_up, ws, mode, group_name=None):
    validate_tail("latent_tail", y_n, w_up, ws, mode, group_name)
    return y_n.new_empty((y_n.shape[0], w_up.shape[0]))


latent_tail = _define(
    "latent_tail(Tensor y_n, Tensor w_up, Tensor ws, str mode, str? group_name=None) -> Tensor",
    _latent_tail, _latent_tail_fake,
)
