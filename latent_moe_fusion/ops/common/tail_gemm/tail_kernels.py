"""Triton kernels of the latent tail: out = round(((A @ W^T) + F[0]) + F[1] + ... + F[R-1]).

A [M, K] activations, W [N, K] weight (nn.Linear layout), F a strided [R, M, N] view of the shared
fragments; everything accumulates in fp32 and is rounded once when stored. The fragments are added
to the matmul accumulator in the fixed order r = 0..R-1 (the association of ops/common/reference_math.py::tail_math),
so a given kernel configuration is bitwise deterministic run to run.

Kernels, chosen per M bucket by tail_gemm_configs.py:
- `tail_gemv_kernel` (tail_gemv.py, one or two tokens): a CUDA-core GEMV, many small programs.
- `tail_swap_kernel` / `tail_swap_tma_kernel` (decode, small M): swap-AB, the accumulator is out^T [BLOCK_N, BLOCK_M] so that
  the weight rows fill the matrix unit's wide side and M is padded only to 16. The grid tiles N
  (and optionally K: SPLIT_K > 1) so that every SM streams its share of W. Split-K partials go to
  an fp32 workspace; the last CTA of an N tile to arrive (an int32 counter, not fp32 atomics) sums
  them in the order s = 0..SPLIT_K-1 and runs the epilogue, then resets its counter to 0. The `_tma`
  variant reads W and A through host-built tensor descriptors (Hopper's bulk copy engine).
- `tail_tile_kernel` (prefill): an output-tiled, grouped-order, optionally persistent tl.dot kernel
  with the fragment reduction in the epilogue; the `_tma` variant reads A and W through host-built
  tensor descriptors (Hopper's bulk copy engine).

Out-of-range W rows are clamped (they re-read row N-1 and are never stored) so that the main loops
load W without masks; padded A rows of the swap kernel are masked (no traffic); K tails are masked only when K is not a multiple of the K step.
`DOT_FP32` casts the dot operands to fp32: the interpreter's bf16 tl.dot is wrong (triton #11584).
`LARGE_OFFSETS` computes element offsets in int64: the launcher sets it where some tensor reaches past int32 offsets
(ops/common/element_offsets.py), so every other launch compiles to the int32 code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..gdc import prefetch_rows_l2, wait_for_predecessor


@triton.jit
def _add_fragments_and_store(acc, f_ptr, out_ptr, f_offs, o_offs, mask, s_fr, R: tl.constexpr, GROUP: tl.constexpr,
                             LARGE_OFFSETS: tl.constexpr):
    # Fragments are added in order r = 0..R-1, GROUP of them in flight at a time (GROUP divides R):
    # all R for small accumulators, fewer where holding them would spill the accumulator's registers.
    for r0 in tl.range(0, R, GROUP, loop_unroll_factor=1):
        for j in tl.static_range(GROUP):
            r = r0 + j
            if LARGE_OFFSETS:
                r = r.to(tl.int64)
            acc += tl.load(f_ptr + r * s_fr + f_offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swap_epilogue(
    acc, offs_n, offs_m, pid_n, pid_k, f_ptr, out_ptr, part_ptr, count_ptr, M, N,
    s_fr, s_fm, s_fn, s_om, s_on, R: tl.constexpr, SPLIT_K: tl.constexpr, FRAG_GROUP: tl.constexpr,
    LARGE_OFFSETS: tl.constexpr,
):
    # offs_n and offs_m come in int64 where LARGE_OFFSETS; the split index joins them.
    if LARGE_OFFSETS:
        pid_k = pid_k.to(tl.int64)
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    f_offs = offs_m[None, :] * s_fm + offs_n[:, None] * s_fn
    o_offs = offs_m[None, :] * s_om + offs_n[:, None] * s_on
    if SPLIT_K == 1:
        _add_fragments_and_store(acc, f_ptr, out_ptr, f_offs, o_offs, mask, s_fr, R, FRAG_GROUP, LARGE_OFFSETS)
    else:
        p_offs = offs_m[None, :] * N + offs_n[:, None]
        tl.store(part_ptr + pid_k * M * N + p_offs, acc, mask=mask)
        # Every thread's partial is written before one thread publishes arrival (release, gpu scope).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            # Last CTA of this N tile: fixed-order sum of the partials (L2 reads: .cg skips L1).
            acc = tl.load(part_ptr + p_offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(part_ptr + s * M * N + p_offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (and graph replay)
            _add_fragments_and_store(acc, f_ptr, out_ptr, f_offs, o_offs, mask, s_fr, R, FRAG_GROUP, LARGE_OFFSETS)


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def tail_swap_kernel(
    a_ptr, w_ptr, f_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, steps_per_split,
    s_am, s_ak, s_wn, s_wk, s_fr, s_fm, s_fn, s_om, s_on,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FRAG_GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_STEPS: tl.constexpr = 0,
    LARGE_OFFSETS: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if LARGE_OFFSETS:
        offs_n = offs_n.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
    rows_w = tl.minimum(offs_n, N - 1)
    in_m = (offs_m < M)[None, :]  # padded A rows are masked, not re-read: no extra L2 traffic at M < 16
    # K is walked in whole BLOCK_K steps so that the compiler sees 16-byte aligned, vectorisable loads.
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, tl.cdiv(K, BLOCK_K))
    if PDL:
        # Launched as a programmatic dependent: the weight rows do not depend on the kernels before, so
        # their first PREFETCH_STEPS steps head for L2 (rows contiguous along K, checked by the launcher)
        # before waiting for the kernel that writes A and the fragments. Nothing is written before the wait.
        if PREFETCH_STEPS > 0:
            w_bytes: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
            row_bytes = tl.minimum(step_hi - step_lo, PREFETCH_STEPS) * (BLOCK_K * w_bytes)
            first = (w_ptr + rows_w.to(tl.int64) * s_wn + step_lo * BLOCK_K).to(tl.int64)
            prefetch_rows_l2(first, tl.zeros([BLOCK_N], dtype=tl.int32) + row_bytes)
        wait_for_predecessor()
    offs_k = step_lo * BLOCK_K + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows_w[:, None] * s_wn + offs_k[None, :] * s_wk
    a_ptrs = a_ptr + offs_m[None, :] * s_am + offs_k[:, None] * s_ak  # A^T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        if EVEN_K:
            w = tl.load(w_ptrs)
            a = tl.load(a_ptrs, mask=in_m, other=0.0)
        else:
            in_k = (step * BLOCK_K + tl.arange(0, BLOCK_K)) < K
            w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=in_k[:, None] & in_m, other=0.0)
        if DOT_FP32:
            w = w.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(w, a, acc, input_precision=PRECISION)
        w_ptrs += BLOCK_K * s_wk
        a_ptrs += BLOCK_K * s_ak

    _swap_epilogue(acc, offs_n, offs_m, pid_n, pid_k, f_ptr, out_ptr, part_ptr, count_ptr, M, N,
                   s_fr, s_fm, s_fn, s_om, s_on, R, SPLIT_K, FRAG_GROUP, LARGE_OFFSETS)


@triton.jit(do_not_specialize=["M", "steps_per_split"])
def tail_swap_tma_kernel(
    a_desc, w_desc, f_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, steps_per_split,
    s_fr, s_fm, s_fn, s_om, s_on,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FRAG_GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    LARGE_OFFSETS: tl.constexpr = False,
):
    # tail_swap_kernel with the W and A tiles fetched by the bulk copy engine; rows past M or N and
    # the K tail are zero-filled by the descriptors and cost no memory traffic.
    if PDL:  # launched as a programmatic dependent: wait before the first read or write
        wait_for_predecessor()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        w = w_desc.load([pid_n * BLOCK_N, step * BLOCK_K])
        a = a_desc.load([0, step * BLOCK_K])
        if DOT_FP32:
            w = w.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(w, a.T, acc, input_precision=PRECISION)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    if LARGE_OFFSETS:
        offs_n = offs_n.to(tl.int64)
        offs_m = offs_m.to(tl.int64)
    _swap_epilogue(acc, offs_n, offs_m, pid_n, pid_k, f_ptr, out_ptr, part_ptr, count_ptr, M, N,
                   s_fr, s_fm, s_fn, s_om, s_on, R, SPLIT_K, FRAG_GROUP, LARGE_OFFSETS)


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row-tiles sweep the N tiles together so W tiles are reused from L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((tile % in_group) % group_rows)
    pid_n = (tile % in_group) // group_rows
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M"])
def tail_tile_kernel(
    a_ptr, w_ptr, f_ptr, out_ptr,
    M, N, K,
    s_am, s_ak, s_wn, s_wk, s_fr, s_fm, s_fn, s_om, s_on,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FRAG_GROUP: tl.constexpr,
    FLATTEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    LARGE_OFFSETS: tl.constexpr = False,
):
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if LARGE_OFFSETS:
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
        rows_a = tl.minimum(offs_m, M - 1)
        rows_w = tl.minimum(offs_n, N - 1)
        a_ptrs = a_ptr + rows_a[:, None] * s_am + offs_k[None, :] * s_ak
        w_ptrs = w_ptr + rows_w[None, :] * s_wn + offs_k[:, None] * s_wk  # W^T tile [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                in_k = (k + offs_k) < K
                a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
            if DOT_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * s_ak
            w_ptrs += BLOCK_K * s_wk
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        f_offs = offs_m[:, None] * s_fm + offs_n[None, :] * s_fn
        o_offs = offs_m[:, None] * s_om + offs_n[None, :] * s_on
        _add_fragments_and_store(acc, f_ptr, out_ptr, f_offs, o_offs, mask, s_fr, R, FRAG_GROUP, LARGE_OFFSETS)


@triton.jit(do_not_specialize=["M"])
def tail_tile_tma_kernel(
    a_desc, w_desc, f_ptr, out_ptr,
    M, N, K,
    s_fr, s_fm, s_fn, s_om, s_on,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FRAG_GROUP: tl.constexpr,
    FLATTEN: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    LARGE_OFFSETS: tl.constexpr = False,
):
    # Descriptors zero-fill out-of-range rows and K tails, so no clamping or masks in the main loop.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            w = w_desc.load([off_n, k])
            if DOT_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w.T, acc, input_precision=PRECISION)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        if LARGE_OFFSETS:
            offs_m = offs_m.to(tl.int64)
            offs_n = offs_n.to(tl.int64)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        f_offs = offs_m[:, None] * s_fm + offs_n[None, :] * s_fn
        o_offs = offs_m[:, None] * s_om + offs_n[None, :] * s_on
        _add_fragments_and_store(acc, f_ptr, out_ptr, f_offs, o_offs, mask, s_fr, R, FRAG_GROUP, LARGE_OFFSETS)
