"""Stand-ins and references shared by the symmetric-exchange tests (CPU processes, one GPU, two GPUs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from latent_moe_fusion.ops.common.symm_exchange import SymmetricExchange, flag_bytes, region_sizes


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


def workspace_sizes(world: int, max_tokens: int, hidden: int, itemsize: int = 4) -> tuple[int, int, int]:
    """(fragment region, output region, whole buffer) bytes of a workspace, as prepare_symmetric_exchange sizes it
    (itemsize 4: room for float32 parts too)."""
    fragment_bytes, output_bytes = region_sizes(world, max_tokens, hidden, itemsize)
    return fragment_bytes, output_bytes, fragment_bytes + output_bytes + flag_bytes(world)


def shared_cpu_buffers(world: int, max_tokens: int, hidden: int) -> list[torch.Tensor]:
    """One workspace buffer per rank in shared memory (every gloo worker maps all of them): NaN bytes in the
    regions, the flags at rest, as prepare_symmetric_exchange leaves them."""
    fragment_bytes, output_bytes, total = workspace_sizes(world, max_tokens, hidden)
    buffers = [torch.full((total,), 0xFF, dtype=torch.uint8) for _ in range(world)]
    for buffer in buffers:
        buffer[fragment_bytes + output_bytes:] = 0
        buffer.share_memory_()
    return buffers


def cpu_exchange(rank: int, buffers: list[torch.Tensor], max_tokens: int, hidden: int, barrier: Callable[[], None],
                 group_name: str = "g", setting: str = "on", method: str = "copies") -> SymmetricExchange:
    """A SymmetricExchange over CPU buffers that every rank's process maps (BufferHandle), small grids."""
    world = len(buffers)
    fragment_bytes, output_bytes, _ = workspace_sizes(world, max_tokens, hidden)
    return SymmetricExchange(group_name, world, rank, torch.device("cpu"), max_tokens, hidden, setting, buffers[rank],
                             BufferHandle(buffers, barrier), fragment_bytes, output_bytes, method=method,
                             max_programs=3, fragment_programs=2)
