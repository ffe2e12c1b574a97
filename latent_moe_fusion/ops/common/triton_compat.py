"""What differs between the Triton releases that the supported torch versions pin, in one place.

torch 2.11 pins Triton 3.6, torch 2.12 and 2.13 pin 3.7.1, torch 2.14 pins 3.8. The Gluon kernels use Gluon's
experimental API, which changes between releases; every difference the kernels meet is named here, and the kernels
import the name from here instead of testing versions themselves.
"""

from __future__ import annotations

import triton
from triton.experimental.gluon import language as gl

TRITON_VERSION: tuple[int, int] = tuple(int(part) for part in triton.__version__.split(".")[:2])  # type: ignore[assignment]

# The CTA-wide barrier (bar.sync over the whole CTA): `gl.thread_barrier()` up to Triton 3.6, `gl.barrier()` from
# 3.7 on (thread_barrier is gone there). Called inside @gluon.jit functions as `cta_barrier()`.
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
