"""Elementwise numerics shared by the expert kernels: SiTU and rounding to the activation dtype."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # Stable for large |x| (exp of a non-positive argument); the error near 0 is a few FP32 ulps of x.
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, r, -r)


@triton.jit
def situ(g, u, beta, lin_beta):
    """SiTU(g, u) in FP32, the order of ops.common.reference_math.situ."""
    return (beta * _tanh(g / beta) * tl.sigmoid(g)) * (lin_beta * _tanh(u / lin_beta))


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """FP32 -> dtype, round to nearest even.

    Under TRITON_INTERPRET=1 (triton 3.6) a float32 -> bfloat16 cast truncates; round the bits
    first there so that the CPU tests see the GPU's rounding.
    """
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)
