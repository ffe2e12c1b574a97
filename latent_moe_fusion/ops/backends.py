"""Backend registry: each op has a pure-PyTorch reference and may have faster backends.

Selection is by priority among backends that are available (installed, right architecture) and
that support the arguments (sizes, dtypes). Availability is a property of the installation and
the arguments are the same on every rank, so the choice is rank-consistent as long as every rank
has the same installation; the fusion pass agrees availability across the group when it is built.
`LMF_BACKEND=<name>` (all ops) or `LMF_BACKEND_<OP>=<name>` forces one backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Reason = str | None  # None means "yes"


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
    return os.environ.get(f"LMF_BACKEND_{op.upper()}") or os.environ.get("LMF_BACKEND") or None


def explain(op: str, device_type: str, *args: Any) -> list[tuple[str, Reason]]:
    """(backend, reason it cannot run or None) for every backend of `op`, in priority order."""
    rows = []
    for b in backends_for(op):
        if device_type not in b.device_types:
            rows.append((b.name, f"runs on {b.device_types}, not {device_type}"))
            continue
        reason = b.available()
        if reason is None:
            reason = b.supports(*args)
        rows.append((b.name, reason))
    return rows


def select_backend(op: str, device_type: str, *args: Any) -> Backend:
    forced = forced_backend_name(op)
    rows = explain(op, device_type, *args)
    by_name = {b.name: b for b in backends_for(op)}
    if forced is not None and forced in by_name:
        reason = dict(rows)[forced]
        if reason is not None:
            raise RuntimeError(f"lmf::{op}: backend {forced!r} was forced (LMF_BACKEND*) but cannot run: {reason}")
        return by_name[forced]
    for name, reason in rows:
        if reason is None:
            return by_name[name]
    detail = "; ".join(f"{n}: {r}" for n, r in rows)
    raise RuntimeError(f"lmf::{op}: no backend can run these arguments on {device_type} ({detail})")
