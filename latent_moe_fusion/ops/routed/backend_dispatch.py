"""Backend dispatch of the routed-expert ops (lmf::routed_experts, lmf::moe_shared_producer and the producer inside
lmf::route_and_produce): select the backend, then the expert id range check, deferred past the launches where the
backend allows it."""

from __future__ import annotations

import torch

from ..common.backends import select_backend
from .expert_ids_check import check_ids


def _run_routed_backend(op: str, topk_ids: torch.Tensor, num_experts: int, args: tuple):
    """Select the backend and run it, with the id range check finished after its launches where the
    backend's kernels allow it (validation.DeferredIdCheck)."""
    backend = select_backend(op, args[0].device.type, *args)
    pending = check_ids(op, topk_ids, num_experts, defer=backend.bad_ids_safe)
    out = backend.fn(*args)
    if pending is not None:
        pending.finish()
    return out
