"""The CUDA device's compute capability, read once per device.

Backend availability checks run on every op call; `torch.cuda.get_device_capability` reads the device's
properties each time, and a device's capability never changes.
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
