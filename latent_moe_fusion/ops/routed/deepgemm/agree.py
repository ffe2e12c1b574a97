"""Agree the DeepGEMM probe across a process group so that every rank picks the same backend.

One all_reduce(MIN) of a small int vector: entry i is R (the group size, meaning "have it") when
this rank can use API group i, else this rank's index. After the MIN every rank holds, per item,
either R (all ranks have it) or the lowest rank that lacks it, so the answer is the conservative
one and its reason names that rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .probe import API_GROUPS, DeepGemmProbe, probe_deepgemm

_AGREED: dict[str, DeepGemmProbe] = {}  # group_name -> agreed answer


def agree_probe(probe: DeepGemmProbe, group: dist.ProcessGroup | None = None) -> DeepGemmProbe:
    """The answer every rank of `group` shares: an item is kept only if all ranks have it."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    vec = torch.tensor([world if probe.has(g) else rank for g in API_GROUPS], dtype=torch.int64, device=device)
    dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)
    lowest_lacking = vec.tolist()
    apis = frozenset(g for g, who in zip(API_GROUPS, lowest_lacking, strict=True) if who == world)
    reasons = [f"{g} missing on rank {who}" for g, who in zip(API_GROUPS, lowest_lacking, strict=True) if who != world]
    if probe.reason:
        reasons.append(f"rank {rank}: {probe.reason}")
    return DeepGemmProbe(bool(apis), "; ".join(reasons), probe.arch, apis, probe.version)


def agree_deepgemm(group: dist.ProcessGroup | None = None) -> DeepGemmProbe:
    """Probe locally, agree over `group` (collective: call it on every rank) and remember the answer.

    The fusion pass calls this when it is built; `prepare_deepgemm_producer` calls it too. Backends
    then use the agreed answer, so absence on any rank means Triton/reference on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        return agree_local()
    group = group if group is not None else dist.group.WORLD
    agreed = agree_probe(probe_deepgemm(), group)
    _AGREED[group.group_name] = agreed
    return agreed


def agree_local() -> DeepGemmProbe:
    """For R = 1 (no group): the local probe is the agreed answer."""
    agreed = probe_deepgemm()
    _AGREED[""] = agreed
    return agreed


def agreed_for(group_name: str | None) -> DeepGemmProbe | None:
    """The agreed answer for the group named `group_name` (None: a single rank), if any."""
    return _AGREED.get(group_name or "")


def current_answer() -> DeepGemmProbe:
    """The most conservative answer known: the intersection of every agreed one, else the local probe."""
    local = probe_deepgemm()
    if not _AGREED:
        return local
    apis = local.apis
    reasons = [local.reason] if local.reason else []
    for name, agreed in _AGREED.items():
        apis = apis & agreed.apis
        if agreed.reason:
            reasons.append(f"group {name or 'local'}: {agreed.reason}")
    return DeepGemmProbe(bool(apis), "; ".join(dict.fromkeys(reasons)), local.arch, apis, local.version)


def reset_agreement() -> None:
    _AGREED.clear()
