"""torch.library registration of the lmf ops: schema, fake (meta) impl, backend dispatch.

Every op is functional (returns outputs, mutates nothing). The real impl validates the
arguments, picks a backend (see backends.py) and runs it; the fake impl validates and returns
empty tensors of the right shape so that torch.compile catches bad arguments at trace time.

The ops are defined with `torch.library.Library` (schema, CPU and CUDA kernels, fake impl) rather than
`torch.library.custom_op`, whose Python autograd and aliasing-check layers run on every call: on the
H200's host the producer's minimum host time per call is 50-80 us lower this way (docs/design/prefill.md),
time a prefill forward outside CUDA graphs pays as GPU idle time. The ops are not differentiable:
autograd passes over them (their outputs never require grad), so a backward through one fails loudly.
"""

from __future__ import annotations

import functools

import torch

_LIB = torch.library.Library("lmf", "DEF")  # module-level: the ops live as long as the process


def _define(schema: str, impl, fake) -> torch._ops.OpOverloadPacket:
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))

    @functools.wraps(impl)
    def kernel(*args):
        # Autograd falls through to here: run below it, so that the torch ops of the reference backend
        # record no graph either (every backend's outputs then equally never require grad).
        with torch._C._AutoDispatchBelowAutograd():
            return impl(*args)

    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")  # not differentiable (module docstring)
    torch.library.register_fake(f"lmf::{name}", fake, lib=_LIB)
    return getattr(torch.ops.lmf, name)
