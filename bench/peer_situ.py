"""SiTU as a fused activation of the peer's matmul_ogs (its hook `FusedActivation`; SwiGLU is the one it ships).

matmul_ogs calls the activation on each FP32 accumulator tile [BLOCK_M, BLOCK_N] of L1 after the K loop and stores
the returned [BLOCK_M, BLOCK_N / 2] tile in the activation dtype; its SwiGLU (`swiglu_details._swiglu_fn`) reads the
tile as (gate, linear) column pairs, which is why w13's gate and up rows are interleaved (bench/peer_layout.py).
`situ_pairs` reads the same pairs and computes SiTU in FP32 with the formula and tanh of our kernels
(ops/common/triton_numerics.py): the two sides' activations differ only in rounding order inside FP32, not in
method. This module imports no triton_kernels, so the function is tested under the Triton interpreter without it.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTIVATION_NAME = "lmf_situ"  # matmul_ogs caches its specialised kernels by this name: unique beside "swiglu"


@triton.jit
def _tanh(x):
    # exp of a non-positive argument: no overflow for large |x|; near 0 the error is a few FP32 ulps of x
    t = tl.exp(-2.0 * tl.abs(x))
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, r, -r)


@triton.jit(repr=lambda _: "_lmf_situ")
def situ_pairs(acc, beta, lin_beta):
    """[M, 2n] FP32 (gate, up) column pairs -> [M, n] SiTU = (beta tanh(g / beta) sigmoid(g)) (lin_beta tanh(u / lin_beta))."""
    gate, up = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1] // 2, 2)))
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    return (beta * _tanh(gate / beta) * tl.sigmoid(gate)) * (lin_beta * _tanh(up / lin_beta))


def situ_activation(beta: float, lin_beta: float):
    """The FusedActivation for matmul_ogs's L1 (reduction_n = 2: two accumulator columns make one output column).
    Needs bench/peer_layout.use_triton_kernels first."""
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation

    return FusedActivation(FnSpecs(ACTIVATION_NAME, situ_pairs, ("beta", "lin_beta"), reduction_n=2),
                           (float(beta), float(lin_beta)))
