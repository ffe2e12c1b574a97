"""Capabilities the fusion decision depends on, agreed across the process group when the pass is built.

A rank that fuses while another does not would run different collectives and hang. So everything
local that matters (the LMF_DISABLE_FUSION switch, which backends this installation can run) is
all-gathered once, at construction: fusion is disabled if any rank disables it, and a backend counts
only if every rank has it. Nothing here runs a collective inside a compile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from latent_moe_fusion import envs

from ..ops.common.backends import backends_for

DISABLE_ENV = "LMF_DISABLE_FUSION"
FUSED_OPS = ("moe_shared_producer", "latent_tail", "noaux_tc_route", "route_and_project", "route_and_produce",
             "route_gather_and_produce")


def disabled_by_env() -> bool:
    return envs.read(DISABLE_ENV)


@dataclass(frozen=True)
class Capabilities:
    disabled: bool  # LMF_DISABLE_FUSION set on at least one rank
    backends: frozenset[tuple[str, str]]  # (op, backend name) available on every rank
    ranks: int  # how many ranks agreed (1 without torch.distributed)

    def key(self) -> str:
        """Stable text for uuid()."""
        return f"disabled={self.disabled};backends={sorted(self.backends)};ranks={self.ranks}"


def local_capabilities() -> Capabilities:
    available = set()
    for op in FUSED_OPS:
        for backend in backends_for(op):
            try:
                ok = backend.available() is None
            except Exception:  # an availability probe that fails means "not available"
                ok = False
            if ok:
                available.add((op, backend.name))
    return Capabilities(disabled_by_env(), frozenset(available), 1)


def agree_capabilities(group: dist.ProcessGroup | None = None) -> Capabilities:
    """This rank's capabilities combined with every rank's of `group` (default: the world group).

    Collective when torch.distributed is initialized: every rank of the group must build the pass.
    """
    local = local_capabilities()
    if not (dist.is_available() and dist.is_initialized()):
        return local
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return local
    gathered: list = [None] * world
    payload = (local.disabled, sorted(local.backends))
    if dist.get_backend(group) == "nccl" and torch.cuda.is_available():
        torch.cuda.current_device()  # object collectives on NCCL use the current device
    dist.all_gather_object(gathered, payload, group=group)
    disabled = any(entry[0] for entry in gathered)
    backends = frozenset.intersection(*(frozenset(map(tuple, entry[1])) for entry in gathered))
    return Capabilities(disabled, backends, world)
