"""Stand-ins and references shared by the symmetric-exchange tests (CPU processes, one GPU, two GPUs)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class BufferHandle:
    """The _SymmetricMemory calls the exchange makes, over one buffer per rank that this process can address
    (shared-memory CPU tensors mapped by every process, or device buffers of one GPU). barrier: what the copies
    method's workspace barrier does here (None: refuse it, for the kernel method, which never calls it)."""

    def __init__(self, buffers: list[torch.Tensor], barrier: Callable[[], None] | None = None) -> None:
        self.buffers, self._barrier, self.channels = buffers, barrier, []

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        numel = 1
        for size in sizes:
            numel *= size
        return self.buffers[rank].view(dtype)[storage_offset:storage_offset + numel].view(tuple(sizes))

    def barrier(self, channel: int = 0) -> None:
        if self._barrier is None:
            raise AssertionError("the kernel method never calls the workspace barrier")
        self.channels.append(channel)
        self._barrier()


def dense_fragments(partials: list[torch.Tensor], mode: str, owner: int) -> torch.Tensor:
    """docs/design.md section 2's ws on rank `owner` from every rank's partial shared output."""
    world = len(partials)
    if mode == "hidden_scatter":
        width = partials[0].shape[1] // world
        return torch.stack([p[:, owner * width:(owner + 1) * width] for p in partials])
    m = partials[0].shape[0] // world
    return torch.stack([p[owner * m:(owner + 1) * m] for p in partials], dim=1)
