"""Form TP (non-SP): partial shared outputs summed by an all_reduce (fused layout `hidden_scatter`)."""

from __future__ import annotations

import torch

from .spec import Form

c10d = torch.ops._c10d_functional


def _reduce(s_partial: torch.Tensor, group_name: str | None, world: int) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_reduce(s_partial, "sum", group_name))


FORM = Form(
    name="all_reduce",
    mode="hidden_scatter",
    description="TP: out = u + all_reduce(shared_partial(x))",
    reduce_shared=_reduce,
    shared_rows=lambda tokens, world: tokens,
)
