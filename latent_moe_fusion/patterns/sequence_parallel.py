"""Form SP: x all-gathered before the shared expert, its output reduce-scattered (layout `token_publish`).

The all_gather stays in the graph: the producer takes the gathered x_s as its input. What the
fusion removes is the reduce_scatter (the producer publishes each token's fragments to its owner).
"""

from __future__ import annotations

import torch

from .spec import Form

c10d = torch.ops._c10d_functional


def _reduce(s_partial: torch.Tensor, group_name: str | None, world: int) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(s_partial, "sum", world, group_name))


FORM = Form(
    name="sequence_parallel",
    mode="token_publish",
    description="SP: out = u + reduce_scatter(shared_partial(all_gather(x)))",
    reduce_shared=_reduce,
    shared_rows=lambda tokens, world: tokens * world,
)
