"""Backend registry: each op has a pure-PyTorch reference and may have faster backends.

Selection is by priority among backends that are available (installed, right architecture) and
that support the arguments (sizes, dtypes). Availability is a property of the installation and
the arguments are the same on every rank, so the choice is rank-consistent as long as every rank
has the same installation; the fusion pass agrees availability across the group when it is built.
`LMF_BACKEND=<name>` (all ops; ops without a backend of that name select as usual) or
`LMF_BACKEND_<OP>=<name>` forces one backend; a name no backend answers to raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from latent_moe_fusion import envs

Reason = str | None  # None means "yes"
ANY_DEVICE = ("cpu", "cuda", "meta")  # the device types of a backend that runs anywhere (pure PyTorch)


@dataclass(frozen=True)
class Backend:
    op: str
    name: str
    priority: int  # lower is tried first
    device_types: tuple[str, ...]
    fn: Callable[..., Any]
    available: Callable[[], Reason] = lambda: None
    supports: Callable[..., Reason] = lambda *args, **kwargs: None
    # Its kernels skip expert ids >= E instead of indexing with them, so the op may finish the id range
    # check after launching them (validation.DeferredIdCheck).
    bad_ids_safe: bool = False


_REGISTRY: dict[str, list[Backend]] = {}


def register_backend(backend: Backend) -> Backend:
    entries = [b for b in _REGISTRY.get(backend.op, []) if b.name != backend.name]
    entries.append(backend)
    entries.sort(key=lambda b: b.priority)
    _REGISTRY[backend.op] = entries
    return backend


def backends_for(op: str) -> list[Backend]:
    return list(_REGISTRY.get(op, []))


def forced_backend_name(op: str) -> str | None:
    return envs.read(f"LMF_BACKEND_{op.upper()}") or envs.read("LMF_BACKEND")


def _check_forced_name(op: str, forced: str, candidates: list[Backend]) -> None:
    """`forced` names no backend of `op`. That is a typo or a missing install: say so instead of silently running the
    default. `LMF_BACKEND` applies to every op, so there it only has to name a backend of some op."""
    per_op = f"LMF_BACKEND_{op.upper()}"
    if envs.is_set(per_op):
        names = ", ".join(b.name for b in candidates)
        raise ValueError(f"{per_op}={forced!r} names no backend of lmf::{op}: expected one of {names} (an optional "
                         "backend is registered only where its package imports), or unset")
    known = sorted({b.name for entries in _REGISTRY.values() for b in entries})
    if forced not in known:
        raise ValueError(f"LMF_BACKEND={forced!r} names no backend of any lmf op: expected one of {', '.join(known)}, "
                         "or unset")


def device_reason(backend: Backend, device_type: str) -> Reason:
    """Why the backend cannot run on this device type; None if it can."""
    if device_type not in backend.device_types:
        return f"runs on {backend.device_types}, not {device_type}"
    return None


def _reason(backend: Backend, device_type: str, *args: Any) -> Reason:
    reason = device_reason(backend, device_type)
    if reason is not None:
        return reason
    reason = backend.available()
    return reason if reason is not None else backend.supports(*args)


def explain(op: str, device_type: str, *args: Any) -> list[tuple[str, Reason]]:
    """(backend, reason it cannot run or None) for every backend of `op`, in priority order."""
    return [(b.name, _reason(b, device_type, *args)) for b in backends_for(op)]


def select_backend(op: str, device_type: str, *args: Any) -> Backend:
    """The first backend in priority order that can run the arguments (the forced one, if any). Stops at
    the first that can: every reason costs host time on each call (tens of us for all of an op's)."""
    return first_runnable(op, lambda backend: _reason(backend, device_type, *args), device_type)


def first_runnable(op: str, reason_of: Callable[[Backend], Reason], device_type: str) -> Backend:
    """select_backend's rule with the reasons given by reason_of(backend) (None: it can run): the forced backend
    if any, else the first in priority order. The plans (ops/tail/tail_plan.py) answer for a device they do not
    have through it."""
    forced = forced_backend_name(op)
    candidates = backends_for(op)
    if forced is not None:
        chosen = [b for b in candidates if b.name == forced]
        if not chosen:
            _check_forced_name(op, forced, candidates)
        if chosen:
            reason = reason_of(chosen[0])
            if reason is not None:
                raise RuntimeError(f"lmf::{op}: backend {forced!r} was forced (LMF_BACKEND*) but cannot run: {reason}")
            return chosen[0]
    for backend in candidates:
        if reason_of(backend) is None:
            return backend
    detail = "; ".join(f"{b.name}: {reason_of(b)}" for b in candidates)
    raise RuntimeError(f"lmf::{op}: no backend can run these arguments on {device_type} ({detail})")
