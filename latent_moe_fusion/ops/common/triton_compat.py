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

# The Triton releases the Gluon kernels are compiled and checked against (offline sm_90 compiles in CI for each;
# timed on the H200 with 3.6). Another release may have changed Gluon's experimental API under them: the routed ops
# then run their portable Triton kernels and say why (gluon_unsupported_reason, in the backend's explanation).
GLUON_TRITON_VERSIONS: tuple[tuple[int, int], ...] = ((3, 6), (3, 7), (3, 8))


def gluon_unsupported_reason() -> str | None:
    """Why the Gluon kernels are not used with this Triton (None where they are)."""
    if TRITON_VERSION not in GLUON_TRITON_VERSIONS:
        tested = ", ".join(f"{a}.{b}" for a, b in GLUON_TRITON_VERSIONS)
        return (f"Triton {triton.__version__}: the Gluon kernels are checked against Triton {tested} only "
                "(Gluon's API is experimental and changes between releases)")
    return None


# What the offline sm_90 compile of each Triton gives the Gluon kernels where it differs from 3.6's, whose figures
# the compile tests hold as their budgets (timed on the H200). Observed offline, not yet timed on a GPU: a larger
# figure here is a known cost of that release, and the compile tests fail on anything beyond it.
OFFLINE_BUDGETS: dict[tuple[int, int], dict[str, float]] = {
    (3, 7): {"staged_spills": 3},
    # one more CTA barrier per step in every TMA / mbarrier loop; more registers, spills and loop instructions
    (3, 8): {"staged_spills": 12, "staged_barriers_per_step": 2, "regs_tma_barriers_per_step": 3,
             "regs_l2_loop_instructions": 229, "fp8_barriers_per_step": 3, "fp8_l1_8_registers": 138,
             "w4a8_barriers_per_step": 2, "kappa_spills": 2, "kappa_barriers_per_step": 4, "ws_spills": 2},
}


def offline_budget(name: str, default: float) -> float:
    """The compile tests' budget `name` under this Triton (OFFLINE_BUDGETS), or `default` (Triton 3.6's)."""
    return OFFLINE_BUDGETS.get(TRITON_VERSION, {}).get(name, default)
