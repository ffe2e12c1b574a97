"""Decode tail for one or two tokens on the CUDA cores: out = round(((A @ W^T) + F[0]) + ... + F[R-1]).

At M <= 2 the tail is a weight stream (W is 51 MB at Kimi K3's sizes, A a few KB). The swap-AB MMA
kernel pads M to 16 and covers 132 SMs with 224 programs of 64 rows; ncu saw it keep DRAM at 66 % with
the SMs active 62.5 % of the time (docs/design/tail.md). Here a program owns BLOCK_N weight
rows (tail_configs.GEMV_CONFIG: 1792 one-warp programs of 4 rows, all resident at once) and multiplies
them with the tokens on the CUDA cores: M FMAs per weight element are free beside its 2 bytes of HBM
traffic. Fewer, wider programs were slower (bench/results/tail_gemv.md, docs/design/tail.md).

Each thread keeps FP32 products of its own (row, token, k) positions across the K loop (no cross-thread
traffic in the loop) and the lanes are reduced once at the end; the first PRELOAD_K columns of every row
are summed separately first. STAGES > 1 lets Triton's pipeliner keep that many K steps in flight through
shared memory (measured slower than plain loads). The order is fixed by the configuration: bitwise
deterministic.

PDL: the weights do not depend on the kernels before, so the first PRELOAD_K columns of this program's
rows are loaded into registers before `griddepcontrol.wait`. As a programmatic dependent of the
producer's combine (~4 us at M = 1, HBM idle meanwhile) the tail thus streams part of W before its
inputs exist. Without PDL the same code runs without the wait (identical results); the wide first load
still pays: 15.3 us at M = 1 with 1024 columns preloaded against 17.9 without (H200, bench/results/tail_gemv.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..gdc import wait_for_predecessor
from .tail_kernels import _add_fragments_and_store


@triton.jit
def _products(w, a_ptrs, a_mask):
    """FP32 w[n, k] * a[m, k] as [BLOCK_N, BLOCK_M, BLOCK_K] (a's padded rows and K tail masked to 0)."""
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    return w.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :]


@triton.jit(do_not_specialize=["M"])
def tail_gemv_kernel(
    a_ptr, w_ptr, f_ptr, out_ptr,
    M, N, K,
    s_am, s_ak, s_wn, s_wk, s_fr, s_fm, s_fn, s_om, s_on,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRELOAD_K: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    FRAG_GROUP: tl.constexpr,
    PDL: tl.constexpr = False,
    LARGE_OFFSETS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if LARGE_OFFSETS:  # element offsets in int64 (tensors past int32 offsets: ops/common/element_offsets.py)
        offs_n = offs_n.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
    rows_w = tl.minimum(offs_n, N - 1)  # rows past N re-read row N - 1 and are never stored
    in_m = (offs_m < M)[:, None]
    head = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PRELOAD_K > 0:
        # The launcher keeps PRELOAD_K <= K; these loads precede the wait (weights only).
        offs_p = tl.arange(0, PRELOAD_K)
        w_head = tl.load(w_ptr + rows_w[:, None] * s_wn + offs_p[None, :] * s_wk)
        if PDL:
            wait_for_predecessor()
        a_ptrs = a_ptr + offs_m[:, None] * s_am + offs_p[None, :] * s_ak
        head = tl.sum(_products(w_head, a_ptrs, in_m), axis=2)
    elif PDL:
        wait_for_predecessor()
    offs_k = PRELOAD_K + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_w[:, None] * s_wn + offs_k[None, :] * s_wk
    a_ptrs = a_ptr + offs_m[:, None] * s_am + offs_k[None, :] * s_ak
    lanes = tl.zeros((BLOCK_N, BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(PRELOAD_K, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            w = tl.load(w_ptrs)
            lanes += _products(w, a_ptrs, in_m)
        else:
            in_k = (k0 + tl.arange(0, BLOCK_K)) < K
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
            lanes += _products(w, a_ptrs, in_m & in_k[None, :])
        w_ptrs += BLOCK_K * s_wk
        a_ptrs += BLOCK_K * s_ak
    acc = head + tl.sum(lanes, axis=2)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    f_offs = offs_m[None, :] * s_fm + offs_n[:, None] * s_fn
    o_offs = offs_m[None, :] * s_om + offs_n[:, None] * s_on
    _add_fragments_and_store(acc, f_ptr, out_ptr, f_offs, o_offs, mask, s_fr, R, FRAG_GROUP, LARGE_OFFSETS)


def gemv_block_sizes(m: int, block_k: int, preload_k: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, PRELOAD_K) for M tokens: M padded to a power of two, the K step and the preload
    shrunk as M grows (the per-thread FP32 products keep their size), the preload a power of two <= K."""
    block_m = triton.next_power_of_2(max(m, 1))
    step = max(16, block_k // block_m)
    preload = min(preload_k // block_m, k)
    preload = 1 << (preload.bit_length() - 1) if preload >= 16 else 0
    return block_m, step, preload
