"""Reference backend of lmf::latent_tail: pure PyTorch, any device, the semantics of docs/design.md. Its cross-rank
movement is always torch.distributed's (the symmetric-memory path is checked against it)."""

from __future__ import annotations

import torch

from ..common.backends import ANY_DEVICE, Backend, register_backend
from ..common.fragment_layouts import gather_columns, rank_tail_operands
from ..common.reference_math import tail_math


def tail_reference(y_n, w_up, ws, mode, group_name) -> torch.Tensor:
    y, w, frags = rank_tail_operands(y_n, w_up, ws, mode, group_name)
    out = tail_math(y, w, frags)
    return gather_columns(out, group_name, symmetric=False) if mode == "hidden_scatter" else out


register_backend(Backend("latent_tail", "reference", 100, ANY_DEVICE, tail_reference))
