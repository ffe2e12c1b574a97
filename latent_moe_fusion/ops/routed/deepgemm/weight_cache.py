"""A cache of weights converted for DeepGEMM, built once per weight (at load or warm-up).

Keyed by each source tensor's storage pointer, shape, strides, dtype and version counter: an
in-place update (load_state_dict, copy_) bumps the version and forces a new conversion. The
entry keeps the source tensors alive, so a pointer cannot be reused by another tensor while its
entry exists. Converting while a CUDA graph is being captured is refused: it would allocate and
record the conversion into the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def _slot(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    return (t.device.type, t.device.index, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _version(t: torch.Tensor | None) -> int:
    return -1 if t is None else t._version


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph (tests monkeypatch this)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class WeightCache:
    def __init__(self, what: str) -> None:
        self.what = what
        # slot -> (versions, sources, converted); one entry per slot, so a stale version is replaced
        self._entries: dict[tuple, tuple[tuple[int, ...], Sequence[torch.Tensor | None], Any]] = {}
        self.conversions = 0  # how many times convert ran (tests read it)

    def get(self, sources: Sequence[torch.Tensor | None], convert: Callable[[], Any]) -> Any:
        slot = tuple(_slot(t) for t in sources)
        versions = tuple(_version(t) for t in sources)
        hit = self._entries.get(slot)
        if hit is not None and hit[0] == versions:
            return hit[2]
        if capturing():
            raise RuntimeError(
                f"{self.what}: weights are not converted yet and a CUDA graph is being captured; "
                "call latent_moe_fusion.ops.routed.deepgemm.prepare_deepgemm_producer(..., weights=...) or run one "
                "eager warm-up call before capture"
            )
        self._entries.pop(slot, None)  # drop a stale conversion before building the new one
        value = convert()
        self.conversions += 1
        self._entries[slot] = (versions, tuple(sources), value)
        return value

    def clear(self) -> None:
        self._entries.clear()
        self.conversions = 0

    def __len__(self) -> int:
        return len(self._entries)
