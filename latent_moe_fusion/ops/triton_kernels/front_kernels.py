"""The decode front in one launch: z = x @ w_down^T and act = SiTU(x @ w1_s^T, x @ w3_s^T) (ops/front.py).

Both read the same tokens x [M, K] and stream a weight each at the copy rate, so one grid of swap-AB programs
serves both: programs [0, DOWN_TILES) take BLOCK_N rows of w_down and store z, the rest take BLOCK_N / 2 rows
of the shared expert's gate weight and the same rows of its up weight, round both products to bf16 like the
library GEMMs they replace, and store SiTU of them rounded to bf16 (the SiTU pass folded into the epilogue).
Every program streams BLOCK_N weight rows over the whole K through one main loop: the rows' addresses are
picked per program before it (pointer loads; the tokens come by TMA), so the loop is the same for both kinds
and the compiler pipelines one loop. (Two loops under a branch, each with its own descriptors, ran 1.3x slower
alone: bench/results/front_branches.md.)

Accumulation: FP32 over K in BLOCK_K steps in K order, like tail_kernels.tail_swap_tma_kernel, whose
down-projection (split_k 1, same BLOCK_M and BLOCK_K) gives the same z.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import round_to, situ


@triton.jit(do_not_specialize=["M"])
def front_swap_kernel(
    x_desc, wd_ptr, w1_ptr, w3_ptr, z_ptr, act_ptr,
    M, N_DOWN, INTER, K, s_wd, s_w1, s_w3, s_zm, s_actm, beta, lin_beta,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    down_tiles = tl.cdiv(N_DOWN, BLOCK_N)
    is_down = pid < down_tiles
    r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past the weight's end re-read its last row (never stored), so the loop loads without row masks.
    down_rows = tl.minimum(pid * BLOCK_N + r, N_DOWN - 1).to(tl.int64)
    j = tl.minimum((pid - down_tiles) * HALF + r % HALF, INTER - 1).to(tl.int64)
    shared_rows = tl.where((r < HALF)[:, None], w1_ptr + j[:, None] * s_w1, w3_ptr + j[:, None] * s_w3)
    w_ptrs = tl.where(is_down, wd_ptr + down_rows[:, None] * s_wd, shared_rows) + offs_k[None, :]
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
    offs_m = tl.arange(0, BLOCK_M)
    in_m = (offs_m < M)[None, :]
    if is_down:
        offs_n = pid * BLOCK_N + r
        tl.store(z_ptr + offs_m[None, :] * s_zm + offs_n[:, None], round_to(acc, z_ptr.dtype.element_ty, INTERPRET),
                 mask=(offs_n < N_DOWN)[:, None] & in_m)
    else:
        g, u = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
        # The library path's roundings: gate and up products to bf16, SiTU in FP32, rounded to bf16.
        g = round_to(g, tl.bfloat16, INTERPRET).to(tl.float32)
        u = round_to(u, tl.bfloat16, INTERPRET).to(tl.float32)
        act = round_to(situ(g, u, beta, lin_beta), act_ptr.dtype.element_ty, INTERPRET)
        offs_j = (pid - down_tiles) * HALF + tl.arange(0, HALF)
        tl.store(act_ptr + offs_m[None, :] * s_actm + offs_j[:, None], act, mask=(offs_j < INTER)[:, None] & in_m)
