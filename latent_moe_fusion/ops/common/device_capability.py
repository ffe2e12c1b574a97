"""The CUDA device's compute capability and SM count, read once per device.

Backend availability checks run on every op call and persistent launches size their grids by the SM count;
`torch.cuda.get_device_capability` / `get_device_properties` read the device's properties each time, and neither
figure ever changes.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def current_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return capability(torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of CUDA device `device` (its index, or the current device's)."""
    return _sm_count(torch.cuda.current_device() if device.index is None else device.index)
