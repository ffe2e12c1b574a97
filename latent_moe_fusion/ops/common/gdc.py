"""Grid dependency control for the kernels launched with PDL (ops/common/pdl.py says when): Triton's, and the
Gluon register-dequant kernels', which inline these @triton.jit helpers (the same PTX as Gluon copies).

`wait_for_predecessor` and `release_dependents` are griddepcontrol.wait / .launch_dependents (no-ops
when the launch was not programmatic). `prefetch_rows_l2` asks the bulk copy engine to bring one
contiguous byte range per element into L2 (cp.async.bulk.prefetch.L2: no registers, no shared
memory, nothing to wait for), which is how a dependent kernel starts streaming its weights before
its predecessor has finished. Inline PTX: never traced under TRITON_INTERPRET=1 (callers pass PDL=False).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_predecessor():
    # A side-effecting asm: loads after it are not hoisted above it.
    tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def release_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def prefetch_rows_l2(addresses, nbytes):
    """addresses: int64 tensor of 16-byte aligned global addresses; nbytes: int32 tensor (same shape) of
    byte counts, multiples of 16; a count <= 0 prefetches nothing."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addresses, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )


# cp.async.wait_group as plain inline PTX: Gluon's async_copy.wait_group makes the compiler add a CTA
# barrier after it, which the Gluon weight rings (routed/gluon/ring_loops.py) do not need: each thread
# reads back only the chunks it copied itself, and their one barrier per step orders the rest.
@triton.jit
def wait_own_copies_0():
    tl.inline_asm_elementwise("cp.async.wait_group 0; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_own_copies_1():
    tl.inline_asm_elementwise("cp.async.wait_group 1; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_own_copies_2():
    tl.inline_asm_elementwise("cp.async.wait_group 2; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
