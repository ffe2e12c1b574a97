"""The routed GEMV kernels of routed/routed_gemv.py in Gluon: the same items and outputs (the FP32
summation order differs: FACTOR sums a word's 8 code products before its scale), with the register layout
fixed by hand (the portable Triton kernel is the CPU interpreter's).

Triton's own layout choice for that kernel routed the activation and the dequantised words through
shared memory (STS / LDS and barriers in the K loop, 7.7 instructions per weight element, static SASS).
Here a thread holds WPT consecutive words of every one of the item's rows ([BLOCK_N, WPT] per thread,
the 32 lanes side by side along K): one WPT x 4-byte load per row and step, the 8 codes of a word
expanded by the prmt table lookup (lut_dequant.py), and each of the 8 activation vectors a[8 j + i]
loaded straight into the column layout of the words, so nothing moves between threads until the
final lane sum.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...common.gdc import prefetch_rows_l2
from ...common.triton_numerics import situ
from .lut_dequant import codes_to_f32, codes_to_f32_unscaled


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _pair_f32(pairs, ODD: gl.constexpr):
    """FP32 value of the low (even k) or high (odd k) bf16 of int32 activation pairs."""
    if ODD:
        return (pairs & -65536).to(gl.float32, bitcast=True)
    return (pairs << 16).to(gl.float32, bitcast=True)


@gluon.jit
def _word_products(words, scales, a_ptrs, lanes, FACTOR: gl.constexpr):
    """lanes += sum over the 8 codes i of word [n, j] of value * a[8 j + i]; a_ptrs: the int32 activation
    pairs (a[8 j], a[8 j + 1]) of every column j. FACTOR: the 8 products of code values are summed first
    and the sum is multiplied by the word's scale once (exact: a power of two), instead of scaling the
    8 values in bf16x2."""
    a01 = gl.load(a_ptrs)[None, :]
    a23 = gl.load(a_ptrs + 1)[None, :]
    a45 = gl.load(a_ptrs + 2)[None, :]
    a67 = gl.load(a_ptrs + 3)[None, :]
    if FACTOR:
        v0, v1, v2, v3, v4, v5, v6, v7 = codes_to_f32_unscaled(words)
        part = v0 * _pair_f32(a01, False)
        part = gl.fma(v1, _pair_f32(a01, True), part)
        part = gl.fma(v2, _pair_f32(a23, False), part)
        part = gl.fma(v3, _pair_f32(a23, True), part)
        part = gl.fma(v4, _pair_f32(a45, False), part)
        part = gl.fma(v5, _pair_f32(a45, True), part)
        part = gl.fma(v6, _pair_f32(a67, False), part)
        part = gl.fma(v7, _pair_f32(a67, True), part)
        # E8M0 byte s -> 2^(s - 127) as FP32 bits s << 23 (byte 0 gives 0, as the table lookup's scale)
        return gl.fma(part, (scales << 23).to(gl.float32, bitcast=True), lanes)
    v0, v1, v2, v3, v4, v5, v6, v7 = codes_to_f32(words, scales)
    lanes = gl.fma(v0, _pair_f32(a01, False), lanes)
    lanes = gl.fma(v1, _pair_f32(a01, True), lanes)
    lanes = gl.fma(v2, _pair_f32(a23, False), lanes)
    lanes = gl.fma(v3, _pair_f32(a23, True), lanes)
    lanes = gl.fma(v4, _pair_f32(a45, False), lanes)
    lanes = gl.fma(v5, _pair_f32(a45, True), lanes)
    lanes = gl.fma(v6, _pair_f32(a67, False), lanes)
    lanes = gl.fma(v7, _pair_f32(a67, True), lanes)
    return lanes


@gluon.jit
def _row_sums(w_ptrs, s_ptrs, w2_off, s2_off, a_ptrs, row_words, DUAL: gl.constexpr, BLOCK_N: gl.constexpr,
              BW: gl.constexpr, L: gl.constexpr, FACTOR: gl.constexpr):
    lanes = gl.zeros([BLOCK_N, BW], gl.float32, layout=L)
    lanes2 = gl.zeros([BLOCK_N, BW], gl.float32, layout=L)
    words = gl.load(w_ptrs)
    scales = gl.load(s_ptrs).to(gl.int32)
    words2 = words
    scales2 = scales
    if DUAL:
        words2 = gl.load(w_ptrs + w2_off)
        scales2 = gl.load(s_ptrs + s2_off).to(gl.int32)
    for kw in range(0, row_words, BW):
        nxt = gl.minimum(kw + BW, row_words - BW)  # the last step reloads itself (in cache)
        words_nx = gl.load(w_ptrs + nxt)
        scales_nx = gl.load(s_ptrs + nxt // 4).to(gl.int32)
        words2_nx = words_nx
        scales2_nx = scales_nx
        if DUAL:
            words2_nx = gl.load(w_ptrs + w2_off + nxt)
            scales2_nx = gl.load(s_ptrs + s2_off + nxt // 4).to(gl.int32)
        lanes = _word_products(words, scales, a_ptrs + 4 * kw, lanes, FACTOR)
        if DUAL:
            lanes2 = _word_products(words2, scales2, a_ptrs + 4 * kw, lanes2, FACTOR)
        words = words_nx
        scales = scales_nx
        words2 = words2_nx
        scales2 = scales2_nx
    return gl.sum(lanes, axis=1), gl.sum(lanes2, axis=1)


@gluon.jit
def _item(item, tiles, slots, ids, valid, rank):
    """(pair, expert as int64, first row) of work item `item`: the (item // tiles)-th valid pair, row tile item % tiles."""
    hit = (valid > 0) & (rank == item // tiles)
    pair = gl.sum(gl.where(hit, slots, 0), axis=0)
    expert = gl.sum(gl.where(hit, ids, 0), axis=0).to(gl.int64)
    return pair, expert, item % tiles


@gluon.jit
def _prefetch_item(item, n_items, tiles, slots, ids, valid, rank, w_ptr, s_ptr, stride_we, stride_se, n_out, row_words,
                   row_scales, DUAL: gl.constexpr, BLOCK_N: gl.constexpr, P_L: gl.constexpr, NW: gl.constexpr):
    """Ask the copy engine to bring an item's weight rows and scales into L2 (one bulk prefetch per
    contiguous block: the gate rows, the up rows, their scales), so that the K loop's loads hit L2."""
    if item < n_items:
        pair, expert, tile = _item(item, tiles, slots, ids, valid, rank)
        lane = gl.arange(0, 32 * NW, layout=P_L)
        half = (lane % 2).to(gl.int64)
        row = (tile * BLOCK_N + half * n_out).to(gl.int64)
        blocks = 2 if DUAL else 1
        w_at = (w_ptr + expert * stride_we + row * row_words).to(gl.int64)
        s_at = (s_ptr + expert * stride_se + row * row_scales).to(gl.int64)
        at = gl.where(lane < 2 * blocks, gl.where(lane < blocks, w_at, s_at), 0)
        nbytes = gl.where(lane < blocks, BLOCK_N * row_words * 4, gl.where(lane < 2 * blocks, BLOCK_N * row_scales, 0))
        prefetch_rows_l2(at, nbytes)


@gluon.jit
def _routed_gemv(
    a_ptr, ids_ptr, w_ptr, s_ptr, out_ptr,
    n_pairs, top_k, n_out, row_words, row_scales, stride_we, stride_se, stride_a, stride_o, beta, lin_beta,
    DUAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    WPT: gl.constexpr,
    BLOCK_P: gl.constexpr,
    NW: gl.constexpr,
    FACTOR: gl.constexpr,
    PREFETCH: gl.constexpr,
):
    """triton/triton_routed_gemv.routed_gemv_kernel's contract, with a_ptr the activations as int32 pairs
    (stride_a in pairs); K steps of 32 x WPT x num_warps words."""
    BW: gl.constexpr = 32 * WPT * NW
    L: gl.constexpr = gl.BlockedLayout([BLOCK_N, WPT], [1, 32], [1, NW], [1, 0])
    P_L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    slots = gl.arange(0, BLOCK_P, layout=P_L)
    ids = gl.load(ids_ptr + slots, mask=slots < n_pairs, other=-1)
    valid = (ids >= 0).to(gl.int32)
    rank = gl.associative_scan(valid, 0, _add) - 1
    n_valid = gl.sum(valid, axis=0)
    tiles = n_out // BLOCK_N
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
    cols = gl.arange(0, BW, layout=gl.SliceLayout(0, L))
    a_div = top_k if DUAL else 1
    n_items = n_valid * tiles
    if PREFETCH:
        _prefetch_item(pid, n_items, tiles, slots, ids, valid, rank, w_ptr, s_ptr, stride_we, stride_se, n_out,
                       row_words, row_scales, DUAL, BLOCK_N, P_L, NW)
    for item in range(pid, n_items, nprog):
        if PREFETCH:  # the next item's rows stream in while this one is computed
            _prefetch_item(item + nprog, n_items, tiles, slots, ids, valid, rank, w_ptr, s_ptr, stride_we, stride_se,
                           n_out, row_words, row_scales, DUAL, BLOCK_N, P_L, NW)
        pair, expert, tile = _item(item, tiles, slots, ids, valid, rank)
        rows = tile * BLOCK_N + offs_n
        w_rows = w_ptr + expert * stride_we + rows[:, None].to(gl.int64) * row_words + cols[None, :]
        s_rows = s_ptr + expert * stride_se + rows[:, None].to(gl.int64) * row_scales + (cols // 4)[None, :]
        a_ptrs = a_ptr + (pair // a_div).to(gl.int64) * stride_a + 4 * cols  # int32 pairs of bf16
        acc, up = _row_sums(w_rows, s_rows, n_out * row_words, n_out * row_scales, a_ptrs, row_words, DUAL,
                            BLOCK_N, BW, L, FACTOR)
        o_ptrs = out_ptr + pair.to(gl.int64) * stride_o + rows
        if DUAL:
            gl.store(o_ptrs, situ(acc, up, beta, lin_beta).to(out_ptr.dtype.element_ty))
        else:
            gl.store(o_ptrs, acc)


@gluon.jit(do_not_specialize=["n_pairs", "top_k"])
def routed_gemv_l1_kernel(
    z_ptr, ids_ptr, w_ptr, s_ptr, act_ptr,
    n_pairs, top_k, inter, row_words, row_scales, stride_we, stride_se, stride_z, stride_act, beta, lin_beta,
    BLOCK_N: gl.constexpr, WPT: gl.constexpr, BLOCK_P: gl.constexpr, num_warps: gl.constexpr,
    FACTOR: gl.constexpr = True, PREFETCH: gl.constexpr = False,
):
    """act[p, n] = bf16(SiTU(W13[e, n] . z[p // top_k], W13[e, inter + n] . z[p // top_k])) (z as bf16 pairs)."""
    _routed_gemv(z_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, n_pairs, top_k, inter, row_words, row_scales, stride_we,
                 stride_se, stride_z, stride_act, beta, lin_beta, True, BLOCK_N, WPT, BLOCK_P, num_warps, FACTOR,
                 PREFETCH)


@gluon.jit(do_not_specialize=["n_pairs", "top_k"])
def routed_gemv_l2_kernel(
    act_ptr, ids_ptr, w_ptr, s_ptr, pairs_ptr,
    n_pairs, top_k, latent, row_words, row_scales, stride_we, stride_se, stride_act, stride_pairs, beta, lin_beta,
    BLOCK_N: gl.constexpr, WPT: gl.constexpr, BLOCK_P: gl.constexpr, num_warps: gl.constexpr,
    FACTOR: gl.constexpr = True, PREFETCH: gl.constexpr = False,
):
    """pairs[p, n] = W2[e, n] . act[p] in FP32 (act as bf16 pairs; beta, lin_beta unused)."""
    _routed_gemv(act_ptr, ids_ptr, w_ptr, s_ptr, pairs_ptr, n_pairs, top_k, latent, row_words, row_scales, stride_we,
                 stride_se, stride_act, stride_pairs, beta, lin_beta, False, BLOCK_N, WPT, BLOCK_P, num_warps, FACTOR,
                 PREFETCH)
