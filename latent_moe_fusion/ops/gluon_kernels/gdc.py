"""Grid dependency control for the Gluon kernels launched with PDL (ops/pdl.py; the Triton twins are in
triton_kernels/gdc.py): griddepcontrol.wait / .launch_dependents, and an L2 bulk prefetch of one
contiguous byte range per weight row."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def wait_for_predecessor():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def release_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def prefetch_rows_l2(addresses, nbytes):
    """addresses: int64 tensor of 16-byte aligned addresses; nbytes: int32 tensor, multiples of 16."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addresses, nbytes], dtype=gl.int32, is_pure=False, pack=1,
    )
