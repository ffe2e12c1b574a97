"""Whether the Triton backends can run here at all (installed Triton, a CUDA device of compute capability 8.0+):
the `available` check of every op's Triton backend."""

from __future__ import annotations

from .backends import Reason
from .device_capability import current_capability


def triton_available() -> Reason:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    capability = current_capability()
    if capability is None:
        return "no CUDA device"
    if capability < (8, 0):
        return "needs compute capability >= 8.0 (bf16 tensor cores)"
    return None
