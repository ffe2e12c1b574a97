"""Form R = 1: the shared expert's output is added as it is (fused layout `local`)."""

from __future__ import annotations

import torch

from .spec import Form


def _reduce(s_partial: torch.Tensor, group_name: str | None, world: int) -> torch.Tensor:
    return s_partial


FORM = Form(
    name="local",
    mode="local",
    description="R = 1: out = u + shared(x)",
    reduce_shared=_reduce,
    shared_rows=lambda tokens, world: tokens,
)
