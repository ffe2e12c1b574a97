"""The routed GEMV's items (one valid (token, slot) pair's 16 weight rows) on the tensor cores: mma.sync
m16n8k16 with the dequantised weights as the register A operand and the pair's activation as B.

Why: the CUDA-core GEMV (routed_gemv.py) is bound by the ALU pipe (H200, ncu: ALU pipe 61-63 % of
peak, issue 62-66 %), and most of its ~24 ALU instructions per 32-bit word (8 codes) go to widening
the looked-up bf16 values into FP32 and to the FMAs' operands. Fed to an MMA, the same lookup
(lut_dequant.dequant_kappa: ~15 ALU instructions per word) is all the ALU work; the products and sums
run on the tensor cores, which decode leaves idle.

A program of NW warps takes 16 rows of one pair's expert (L1: the 16 gate and the 16 up rows) and
cuts K into NW slices, one per warp: warp s multiplies rows i of slice s (A rows 16 s + i) with an
activation tile whose column c holds slice c % NW, so the products a warp needs are in its own
column c = s (the other columns are work the idle tensor cores throw away). After the K loop each
row keeps column s and the NW slice sums are added in slice order (fixed: bitwise deterministic).
The MMA's k order inside each 128-wide step is lut_dequant's kappa permutation; the activation
tile is loaded in the same order. Numerics as the register-dequant wgmma kernels (routed_gemm.py):
exact bf16 weights (codes times the E8M0 scale in bf16x2), bf16 products, FP32 sums.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from ..triton_kernels.numerics import situ
from .lut_dequant import dequant_kappa

STEP_K = gl.constexpr(128)  # k per step: one 16-byte load (4 words, one E8M0 block) per thread and row


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _item(item, tiles, slots, ids, valid, rank):
    """(pair, expert as int64, row tile) of work item `item`: the (item // tiles)-th valid pair, tile item % tiles."""
    hit = (valid > 0) & (rank == item // tiles)
    pair = gl.sum(gl.where(hit, slots, 0), axis=0)
    expert = gl.sum(gl.where(hit, ids, 0), axis=0).to(gl.int64)
    return pair, expert, item % tiles


@gluon.jit
def _weight_ptrs(w_ptr, s_ptr, expert, row0, row_words, row_scales, stride_we, stride_se, k_slice,
                 NW: gl.constexpr):
    """Words [16 NW, 16] (thread: 4 consecutive words of rows lane / 4 + {0, 8}, as dequant_kappa takes them)
    and scale bytes for step 0: A row 16 s + i is weight row row0 + i at k = s * k_slice."""
    BN: gl.constexpr = 16 * NW
    if NW == 8:
        warp_bases: gl.constexpr = [[16, 0], [32, 0], [64, 0]]
    elif NW == 4:
        warp_bases: gl.constexpr = [[16, 0], [32, 0]]
    else:
        gl.static_assert(NW == 2, "2, 4 or 8 warps (K slices)")
        warp_bases: gl.constexpr = [[16, 0]]
    words_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_bases, block_bases=[], shape=[BN, STEP_K // 8])
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, words_l))
    rj = gl.arange(0, STEP_K // 8, layout=gl.SliceLayout(0, words_l))
    row = (row0 + r % 16).to(gl.int64)
    k0 = (r // 16) * k_slice
    w_ptrs = w_ptr + expert * stride_we + (row * row_words + k0 // 8)[:, None] + rj[None, :]
    s_ptrs = s_ptr + expert * stride_se + (row * row_scales + k0 // 32)[:, None] + (rj // 4)[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def _act_ptrs(a_row_ptr, k_slice, NW: gl.constexpr, b_l: gl.constexpr):
    """Activation tile [128, 8] for step 0 in the MMA's k order (kappa = 32 w + 16 c0 + 8 h + 2 q + e holds
    k = 32 q + 8 w + 4 c0 + 2 h + e); column c reads K slice c % NW."""
    kap = gl.arange(0, STEP_K, layout=gl.SliceLayout(1, b_l))
    col = gl.arange(0, 8, layout=gl.SliceLayout(0, b_l))
    k = 32 * ((kap // 2) % 4) + 8 * (kap // 32) + 4 * ((kap // 16) % 2) + 2 * ((kap // 8) % 2) + kap % 2
    return a_row_ptr + k[:, None] + ((col % NW) * k_slice)[None, :]


@gluon.jit
def _slice_sums(acc, NW: gl.constexpr, mma_l: gl.constexpr):
    """[16 NW, 8] -> [16]: row i's sum over slices s of acc[16 s + i, s], added in slice order."""
    r = gl.arange(0, 16 * NW, layout=gl.SliceLayout(1, mma_l))
    col = gl.arange(0, 8, layout=gl.SliceLayout(0, mma_l))
    own = gl.sum(gl.where(col[None, :] == (r // 16)[:, None], acc, 0.0), axis=1)  # one nonzero term: exact
    return gl.reduce(gl.reshape(own, [NW, 16]), 0, _add)


@gluon.jit
def _load_step(w_ptrs, s_ptrs, w2_off, s2_off, b_ptrs, k, DUAL: gl.constexpr):
    """One step's words and scale bytes (and the second row set's if DUAL) and activation tile."""
    wd = gl.load(w_ptrs + k // 8)
    sc = gl.load(s_ptrs + k // 32)
    wd2 = wd
    sc2 = sc
    if DUAL:
        wd2 = gl.load(w_ptrs + w2_off + k // 8)
        sc2 = gl.load(s_ptrs + s2_off + k // 32)
    return wd, sc, wd2, sc2, gl.load(b_ptrs + k)


@gluon.jit
def _mma_step(wd, sc, wd2, sc2, b, acc, acc2, DUAL: gl.constexpr, BN: gl.constexpr, a_l: gl.constexpr):
    a = gl.convert_layout(dequant_kappa(wd, sc.to(gl.int32), BN, STEP_K), a_l, assert_trivial=True)
    acc = mma_v2(a, b, acc)
    if DUAL:
        a2 = gl.convert_layout(dequant_kappa(wd2, sc2.to(gl.int32), BN, STEP_K), a_l, assert_trivial=True)
        acc2 = mma_v2(a2, b, acc2)
    return acc, acc2


@gluon.jit
def _row_sums(w_ptrs, s_ptrs, w2_off, s2_off, b_ptrs, k_slice, DUAL: gl.constexpr, NW: gl.constexpr,
              DEPTH: gl.constexpr, mma_l: gl.constexpr, a_l: gl.constexpr):
    """FP32 [16] sums of the item's rows (and with DUAL of the rows w2_off words further) over K; the operands
    of the next DEPTH (1 or 2) steps are in flight while a step's words are expanded."""
    BN: gl.constexpr = 16 * NW
    acc = gl.zeros([BN, 8], gl.float32, layout=mma_l)
    acc2 = gl.zeros([BN, 8], gl.float32, layout=mma_l)
    last = k_slice - STEP_K  # steps past the end reload the last one (in cache)
    wd, sc, wd2, sc2, b = _load_step(w_ptrs, s_ptrs, w2_off, s2_off, b_ptrs, 0, DUAL)
    if DEPTH == 2:
        wd_1, sc_1, wd2_1, sc2_1, b_1 = _load_step(w_ptrs, s_ptrs, w2_off, s2_off, b_ptrs,
                                                   gl.minimum(STEP_K, last), DUAL)
        for k in range(0, k_slice, STEP_K):
            wd_2, sc_2, wd2_2, sc2_2, b_2 = _load_step(w_ptrs, s_ptrs, w2_off, s2_off, b_ptrs,
                                                       gl.minimum(k + 2 * STEP_K, last), DUAL)
            acc, acc2 = _mma_step(wd, sc, wd2, sc2, b, acc, acc2, DUAL, BN, a_l)
            wd, sc, wd2, sc2, b = wd_1, sc_1, wd2_1, sc2_1, b_1
            wd_1, sc_1, wd2_1, sc2_1, b_1 = wd_2, sc_2, wd2_2, sc2_2, b_2
    else:
        for k in range(0, k_slice, STEP_K):
            wd_1, sc_1, wd2_1, sc2_1, b_1 = _load_step(w_ptrs, s_ptrs, w2_off, s2_off, b_ptrs,
                                                       gl.minimum(k + STEP_K, last), DUAL)
            acc, acc2 = _mma_step(wd, sc, wd2, sc2, b, acc, acc2, DUAL, BN, a_l)
            wd, sc, wd2, sc2, b = wd_1, sc_1, wd2_1, sc2_1, b_1
    return _slice_sums(acc, NW, mma_l), _slice_sums(acc2, NW, mma_l)


@gluon.jit
def _routed_gemv_mma(
    a_ptr, ids_ptr, w_ptr, s_ptr, out_ptr,
    n_pairs, top_k, n_out, row_words, row_scales, stride_we, stride_se, stride_a, stride_o, beta, lin_beta,
    DUAL: gl.constexpr, BLOCK_P: gl.constexpr, NW: gl.constexpr, DEPTH: gl.constexpr,
):
    """routed_gemv's item walk with 16-row items: DUAL (L1) act[p, n] = bf16(SiTU(gate, up)) from z row
    p // top_k; else (L2) pairs[p, n] = W2[e, n] . act[p] in FP32. K = 8 row_words, cut into NW slices."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    P_L: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    slots = gl.arange(0, BLOCK_P, layout=P_L)
    ids = gl.load(ids_ptr + slots, mask=slots < n_pairs, other=-1)
    valid = (ids >= 0).to(gl.int32)
    rank = gl.associative_scan(valid, 0, _add) - 1
    n_valid = gl.sum(valid, axis=0)
    tiles = n_out // 16
    k_slice = row_words * 8 // NW
    a_div = top_k if DUAL else 1
    for item in range(pid, n_valid * tiles, nprog):
        pair, expert, tile = _item(item, tiles, slots, ids, valid, rank)
        w_ptrs, s_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, tile * 16, row_words, row_scales, stride_we, stride_se,
                                      k_slice, NW)
        b_ptrs = _act_ptrs(a_ptr + (pair // a_div).to(gl.int64) * stride_a, k_slice, NW, b_l)
        acc, up = _row_sums(w_ptrs, s_ptrs, n_out * row_words, n_out * row_scales, b_ptrs, k_slice, DUAL, NW,
                            DEPTH, mma_l, a_l)
        rows = tile * 16 + gl.arange(0, 16, layout=acc.type.layout)
        o_ptrs = out_ptr + pair.to(gl.int64) * stride_o + rows
        if DUAL:
            gl.store(o_ptrs, situ(acc, up, beta, lin_beta).to(out_ptr.dtype.element_ty))
        else:
            gl.store(o_ptrs, acc)


@gluon.jit(do_not_specialize=["n_pairs", "top_k"])
def routed_mma_l1_kernel(
    z_ptr, ids_ptr, w_ptr, s_ptr, act_ptr,
    n_pairs, top_k, inter, row_words, row_scales, stride_we, stride_se, stride_z, stride_act, beta, lin_beta,
    BLOCK_P: gl.constexpr, num_warps: gl.constexpr, DEPTH: gl.constexpr = 1,
):
    """act[p, n] = bf16(SiTU(W13[e, n] . z[p // top_k], W13[e, inter + n] . z[p // top_k]))."""
    _routed_gemv_mma(z_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, n_pairs, top_k, inter, row_words, row_scales, stride_we,
                     stride_se, stride_z, stride_act, beta, lin_beta, True, BLOCK_P, num_warps, DEPTH)


@gluon.jit(do_not_specialize=["n_pairs", "top_k"])
def routed_mma_l2_kernel(
    act_ptr, ids_ptr, w_ptr, s_ptr, pairs_ptr,
    n_pairs, top_k, latent, row_words, row_scales, stride_we, stride_se, stride_act, stride_pairs, beta, lin_beta,
    BLOCK_P: gl.constexpr, num_warps: gl.constexpr, DEPTH: gl.constexpr = 1,
):
    """pairs[p, n] = W2[e, n] . act[p] in FP32 (beta, lin_beta unused)."""
    _routed_gemv_mma(act_ptr, ids_ptr, w_ptr, s_ptr, pairs_ptr, n_pairs, top_k, latent, row_words, row_scales,
                     stride_we, stride_se, stride_act, stride_pairs, beta, lin_beta, False, BLOCK_P, num_warps, DEPTH)
