"""The shared expert's gate/up GEMM with SiTU in its epilogue, one launch: act = SiTU(x @ w1_s^T, x @ w3_s^T).

Decode (a few tokens): swap-AB programs, each takes BLOCK_N / 2 rows of the gate weight and the same rows of
the up weight over the whole K (one main loop, pointer loads; the tokens by TMA), rounds both products to bf16
like the library GEMM it replaces, and stores SiTU of them rounded to bf16: cuBLAS's split-K GEMM, its reduce
and the SiTU pass in one kernel on few SMs, which leaves the rest to the down-projection beside it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import round_to, situ


@triton.jit(do_not_specialize=["M"])
def shared_gate_up_kernel(
    x_desc, w1_ptr, w3_ptr, act_ptr,
    M, INTER, K, s_w1, s_w3, s_actm, beta, lin_beta,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past INTER re-read the last row (never stored), so the loop loads without row masks.
    j = tl.minimum(tl.program_id(0) * HALF + r % HALF, INTER - 1).to(tl.int64)
    w_ptrs = tl.where((r < HALF)[:, None], w1_ptr + j[:, None] * s_w1, w3_ptr + j[:, None] * s_w3) + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(k + offs_k < K)[None, :], other=0.0)
        x = x_desc.load([0, k])  # rows past M and the K tail are zero-filled
        if DOT_FP32:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, x.T, acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K
    g, u = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
    # The library path's roundings: gate and up products to bf16, SiTU in FP32, rounded to bf16.
    g = round_to(g, tl.bfloat16, INTERPRET).to(tl.float32)
    u = round_to(u, tl.bfloat16, INTERPRET).to(tl.float32)
    act = round_to(situ(g, u, beta, lin_beta), act_ptr.dtype.element_ty, INTERPRET)
    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.program_id(0) * HALF + tl.arange(0, HALF)
    tl.store(act_ptr + offs_m[None, :] * s_actm + offs_j[:, None], act,
             mask=(offs_j < INTER)[:, None] & (offs_m < M)[None, :])
