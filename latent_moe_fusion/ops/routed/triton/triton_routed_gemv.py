"""The portable Triton kernel of the routed GEMV (routed/routed_gemv.py says what it computes and launches it; the
sm_90 form is gluon/gluon_routed_gemv.py): bit-arithmetic dequantisation of weight_tiles, also the CPU interpreter's
path."""

from __future__ import annotations

import triton
import triton.language as tl

from ...common.triton_numerics import round_to, situ
from .weight_tiles import e2m1_to_fp32, e8m0_to_fp32


@triton.jit
def _code_plain(words, scale, i: tl.constexpr):
    codes = (words >> (4 * i)) & 15
    return (e2m1_to_fp32(codes) * scale).to(tl.bfloat16)


@triton.jit
def _codes_plain(words, scales):
    scale = e8m0_to_fp32(scales)
    return (_code_plain(words, scale, 0), _code_plain(words, scale, 1), _code_plain(words, scale, 2),
            _code_plain(words, scale, 3), _code_plain(words, scale, 4), _code_plain(words, scale, 5),
            _code_plain(words, scale, 6), _code_plain(words, scale, 7))


@triton.jit
def _word_products(words, scales, a_ptrs, lanes):
    """lanes += sum over the 8 codes i of word [n, j] of value * a[8 j + i] (a_ptrs: element 8 j)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _codes_plain(words, scales)
    lanes += v0.to(tl.float32) * tl.load(a_ptrs + 0).to(tl.float32)[None, :]
    lanes += v1.to(tl.float32) * tl.load(a_ptrs + 1).to(tl.float32)[None, :]
    lanes += v2.to(tl.float32) * tl.load(a_ptrs + 2).to(tl.float32)[None, :]
    lanes += v3.to(tl.float32) * tl.load(a_ptrs + 3).to(tl.float32)[None, :]
    lanes += v4.to(tl.float32) * tl.load(a_ptrs + 4).to(tl.float32)[None, :]
    lanes += v5.to(tl.float32) * tl.load(a_ptrs + 5).to(tl.float32)[None, :]
    lanes += v6.to(tl.float32) * tl.load(a_ptrs + 6).to(tl.float32)[None, :]
    lanes += v7.to(tl.float32) * tl.load(a_ptrs + 7).to(tl.float32)[None, :]
    return lanes


@triton.jit
def _row_sums(w_ptrs, s_ptrs, w2_off, s2_off, a_ptrs, row_words, DUAL: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_W: tl.constexpr):
    """FP32 [BLOCK_N] dot products of the rows at w_ptrs (word 0) with the activation at a_ptrs (element 0),
    and with DUAL those of the rows w2_off words (s2_off scale bytes) further. The next step's words are
    loaded before this step's are expanded (row_words a multiple of BLOCK_W)."""
    lanes = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    lanes2 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    words = tl.load(w_ptrs)
    scales = tl.load(s_ptrs).to(tl.int32)
    words2 = words
    scales2 = scales
    if DUAL:
        words2 = tl.load(w_ptrs + w2_off)
        scales2 = tl.load(s_ptrs + s2_off).to(tl.int32)
    for kw in range(0, row_words, BLOCK_W):
        nxt = tl.minimum(kw + BLOCK_W, row_words - BLOCK_W)  # the last step reloads itself (in cache)
        words_nx = tl.load(w_ptrs + nxt)
        scales_nx = tl.load(s_ptrs + nxt // 4).to(tl.int32)
        words2_nx = words_nx
        scales2_nx = scales_nx
        if DUAL:
            words2_nx = tl.load(w_ptrs + w2_off + nxt)
            scales2_nx = tl.load(s_ptrs + s2_off + nxt // 4).to(tl.int32)
        lanes = _word_products(words, scales, a_ptrs + 8 * kw, lanes)
        if DUAL:
            lanes2 = _word_products(words2, scales2, a_ptrs + 8 * kw, lanes2)
        words = words_nx
        scales = scales_nx
        words2 = words2_nx
        scales2 = scales2_nx
    return tl.sum(lanes, axis=1), tl.sum(lanes2, axis=1)


@triton.jit(do_not_specialize=["n_pairs", "top_k"])
def routed_gemv_kernel(
    a_ptr, ids_ptr, w_ptr, s_ptr, out_ptr,
    n_pairs, top_k, n_out, row_words, row_scales, stride_we, stride_se, stride_a, stride_o, beta, lin_beta,
    DUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_P: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """DUAL (L1): a = z (row p // top_k), rows n and n_out + n of W13, out = act (bf16 SiTU, row p).
    Else (L2): a = act (row p), rows n of W2, out = pairs (FP32, row p). Words: int32 views of the
    packed weights ([E, rows, row_words]); scales: uint8 [E, rows, row_scales]."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    slots = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + slots, mask=slots < n_pairs, other=-1)
    valid = ids >= 0
    rank = tl.cumsum(valid.to(tl.int32), axis=0) - 1
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    tiles = n_out // BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_W)
    a_div = top_k if DUAL else 1
    for item in range(pid, n_valid * tiles, nprog):
        hit = valid & (rank == item // tiles)
        pair = tl.sum(tl.where(hit, slots, 0), axis=0)
        expert = tl.sum(tl.where(hit, ids, 0), axis=0).to(tl.int64)
        rows = (item % tiles) * BLOCK_N + offs_n
        w_rows = w_ptr + expert * stride_we + rows[:, None].to(tl.int64) * row_words + cols[None, :]
        s_rows = s_ptr + expert * stride_se + rows[:, None].to(tl.int64) * row_scales + (cols // 4)[None, :]
        a_ptrs = a_ptr + (pair // a_div).to(tl.int64) * stride_a + 8 * cols
        acc, up = _row_sums(w_rows, s_rows, n_out * row_words, n_out * row_scales, a_ptrs, row_words, DUAL,
                            BLOCK_N, BLOCK_W)
        o_ptrs = out_ptr + pair.to(tl.int64) * stride_o + rows
        if DUAL:
            tl.store(o_ptrs, round_to(situ(acc, up, beta, lin_beta), out_ptr.dtype.element_ty, INTERPRET))
        else:
            tl.store(o_ptrs, acc)
