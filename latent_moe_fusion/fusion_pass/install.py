"""lmf.install(): put the fusion pass into Inductor's post-grad custom pre slot, keeping what is there."""

from __future__ import annotations

from typing import Any

from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph

from .latent_pass import LatentMoEFusionPass


class ChainedGraphPass(CustomGraphPass):
    """Runs several post-grad passes in order. Cacheable only if every member has a uuid."""

    def __init__(self, *passes: Any) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> Any | None:
        ids = []
        for p in self.passes:
            uid = p.uuid() if isinstance(p, CustomGraphPass) else None
            if uid is None:
                return None  # an opaque member: Inductor must not cache the result
            ids.append((type(p).__qualname__, uid))
        return tuple(ids)


def _members(current: Any) -> list[Any]:
    if current is None:
        return []
    if isinstance(current, ChainedGraphPass):
        return list(current.passes)
    if isinstance(current, (list, tuple)):
        return list(current)
    return [current]


def install(fusion_pass: LatentMoEFusionPass | None = None) -> LatentMoEFusionPass:
    """Install `fusion_pass` (default: a new LatentMoEFusionPass) globally and return it.

    A pass already in `torch._inductor.config.post_grad_custom_pre_pass` keeps running first (the
    order passes were installed in); an earlier LatentMoEFusionPass is replaced, not chained twice.
    Builds the pass when none is given, which is collective under torch.distributed (see the class).
    """
    fusion_pass = fusion_pass if fusion_pass is not None else LatentMoEFusionPass()
    others = [p for p in _members(inductor_config.post_grad_custom_pre_pass) if not isinstance(p, LatentMoEFusionPass)]
    inductor_config.post_grad_custom_pre_pass = ChainedGraphPass(*others, fusion_pass) if others else fusion_pass
    return fusion_pass
