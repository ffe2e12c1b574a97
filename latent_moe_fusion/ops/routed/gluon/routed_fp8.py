"""Routed MXFP4 experts on FP8 MMAs (decode, Gluon, sm_90; LMF_ROUTED_FP8): the e2m1 codes placed as e4m3, the activations
split per row into two e4m3 parts, the E8M0 scales applied to the FP32 sums of each 32-wide k block. L1 (gate and
up, SiTU, bf16 act) is what LMF_ROUTED_FP8=1 (the default) takes; L2 (on L1's act rows, split between the two) is
LMF_ROUTED_FP8=l1,l2 (H200: no faster than the bf16 L2 once its split is paid; docs/design/routed-dequantisation.md).

Why: the bf16 register-dequant kernels (routed_gemm.py) are bound by the dequantiser's instruction count, not by
their bytes (docs/design/routed-dequantisation.md): 17 instructions per weight word, 9 of them on the
half-rate ALU pipe. Here a word (8 codes of one row) becomes two wgmma registers in 7 (5 ALU):

- e2m1 -> e4m3 is a bit placement: sign to bit 7, the magnitude bits (e1 e0 m) to bits 4..2. The byte then reads
  as the code times 2^-6 (code 0.5, the one e2m1 subnormal, lands on an e4m3 subnormal: exact);
- the scale is a power of two per (row, 32 k): one FP32 multiply-add per accumulator and block folds it into the
  sums (``acc += 2^(s - 127) * block``), so the MMA covers exactly one scale block: k32 FP8 wgmmas;
- the activations are bf16; one e4m3 keeps 4 of their 8 significant bits, so each token is split once, outside
  the kernel, as z * 2^f = hi + lo (f a power of two per token putting its largest |z| at the top of e4m3's
  range): two MMAs per block on the same weight registers. Numerics: docs/design/routed-dequantisation.md
  (~3e-5 from float64 against 1.6e-3 for rounding the output to bf16 once; not bitwise the bf16 path).

The k order inside a 32-block: the wgmma register for row r holds k 4q .. 4q + 3 (q = lane % 4) and another
k 16 + 4q .. 16 + 4q + 3. Thread q takes word q of the block (codes 8q .. 8q + 7 of the weight's own order); its
low nibbles (codes 8q + 2e) go to the first register and its high nibbles (8q + 2e + 1) to the second. So the
MMA's k (kappa) is 16 * (k % 2) + k // 2 inside each block: the activation split writes that order (fp8_split).

Thread q now reads word q of each of the step's 4 blocks (4-byte shared loads) instead of one 16-byte load: the
TMA ring's stages are 64-byte swizzled, which makes those loads conflict-free. The K loop: fp8_mainloop.py.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ...common.triton_numerics import situ
from .fp8_mainloop import fp8_mainloop
from .routed_gemm import _valid_rows, store_pair_rows


@gluon.constexpr_function
def act_layout(NW):
    """Activation parts as int32 words [rows, 32] (4 e4m3 values each): one 16-byte load per thread and row."""
    return gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])


@gluon.jit
def _scale_words(s_ptr, expert, n0, row_scales, stride_se, mma_l: gl.constexpr, BN: gl.constexpr):
    """int32 pointers to the tile's scale bytes at k = 0: a step's 4 E8M0 bytes per row, rows in the MMA's layout."""
    rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    rows = s_ptr + expert.to(gl.int64) * stride_se + rn.to(gl.int64) * row_scales
    return rows.to(gl.pointer_type(gl.int32), bitcast=True)


@gluon.jit
def _l1_fp8_rows(z_hi_ptr, z_lo_ptr, col_factor_ptr, s_ptr, w_desc, w_row, expert, sorted_ptr, act_ptr, row0, n0,
                 inter, K, row_scales, stride_se, top_k, beta, lin_beta, ROWS: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    """act[row0 .. row0 + ROWS, n0 .. n0 + BN] = bf16(SiTU(gate, up)) of the rows' tokens."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 32])
    act_l: gl.constexpr = act_layout(NW)
    sg_ptrs = _scale_words(s_ptr, expert, n0, row_scales, stride_se, mma_l, BN)
    su_ptrs = _scale_words(s_ptr, expert, inter + n0, row_scales, stride_se, mma_l, BN)
    pos = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    pair = gl.load(sorted_ptr + pos)
    tok = gl.where(pair >= 0, pair // top_k, 0)
    ak = gl.arange(0, BK // 4, layout=gl.SliceLayout(0, act_l))
    a_off = tok[:, None].to(gl.int64) * (K // 4) + ak[None, :]
    a_mask = (pair >= 0)[:, None] & (ak >= 0)[None, :]
    a_hi_ptrs = z_hi_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + a_off
    a_lo_ptrs = z_lo_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + a_off
    g, u = fp8_mainloop(w_desc, w_row, sg_ptrs, su_ptrs, a_hi_ptrs, a_lo_ptrs, a_mask, K, ROWS, BN, BK, NW, MMA, True)
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l))
    opair = gl.load(sorted_ptr + om)
    factor = gl.load(col_factor_ptr + gl.where(opair >= 0, opair // top_k, 0))
    h = situ(g * factor[None, :], u * factor[None, :], beta, lin_beta)
    gl.store(act_ptr + om[None, :].to(gl.int64) * inter + on[:, None], h.to(act_ptr.dtype.element_ty))


@gluon.jit
def _l2_fp8_rows(a_hi_ptr, a_lo_ptr, row_factor_ptr, s_ptr, w_desc, w_row, expert, sorted_ptr, pairs_ptr, row0, n0,
                 latent, K, row_scales, stride_se, ROWS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                 NW: gl.constexpr, MMA: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T in FP32 for the valid rows of row0 .. row0 + ROWS."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 32])
    act_l: gl.constexpr = act_layout(NW)
    s_ptrs = _scale_words(s_ptr, expert, n0, row_scales, stride_se, mma_l, BN)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    ak = gl.arange(0, BK // 4, layout=gl.SliceLayout(0, act_l))
    a_off = rows[:, None].to(gl.int64) * (K // 4) + ak[None, :]
    a_mask = (rows >= 0)[:, None] & (ak >= 0)[None, :]
    a_hi_ptrs = a_hi_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + a_off
    a_lo_ptrs = a_lo_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + a_off
    acc, _ = fp8_mainloop(w_desc, w_row, s_ptrs, s_ptrs, a_hi_ptrs, a_lo_ptrs, a_mask, K, ROWS, BN, BK, NW, MMA, False)
    factor = gl.load(row_factor_ptr + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l)))
    store_pair_rows(acc * factor[None, :], pairs_ptr, sorted_ptr, row0, n0, latent, mma_l, ROWS, BN)


@gluon.jit
def _by_valid_rows(rows_fn: gl.constexpr, args, sorted_ptr, row0, BM: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    """rows_fn(*args, ROWS, ...) with the MMA's N = ROWS: 8, 16 or 32, the fewest that hold the block's valid rows
    (they come first). Fewer rows, fewer scaled adds (one per accumulator and 32-block). 8-row blocks compile the
    8-row path alone (the L1: 112 registers, 4 CTAs per SM); L2 takes the same test on the block as L1, so it reads
    only rows L1 wrote."""
    if BM == 8:
        rows_fn(*args, 8, BN, BK, NW, MMA)
    else:
        valid = _valid_rows(sorted_ptr, row0, BM, NW)
        if valid <= 8:
            rows_fn(*args, 8, BN, BK, NW, MMA)
        elif BM == 16 or valid <= 16:
            rows_fn(*args, 16, BN, BK, NW, MMA)
        else:
            rows_fn(*args, 32, BN, BK, NW, MMA)


@gluon.jit
def _block_tile(block_expert_ptr, n_total, BN: gl.constexpr):
    """This program's expert block, its first weight row and the block's expert (-1: an unused block)."""
    tiles_n = n_total // BN
    pid = gl.program_id(0)
    blk = pid // tiles_n
    return blk, (pid % tiles_n) * BN, gl.load(block_expert_ptr + blk)


@gluon.jit(do_not_specialize=["top_k"])
def l1_fp8_kernel(z_hi_ptr, z_lo_ptr, col_factor_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K,
                  row_scales, top_k, stride_se, beta, lin_beta, w_desc, BM: gl.constexpr, BK: gl.constexpr,
                  num_warps: gl.constexpr, MMA: gl.constexpr = "pipe"):
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert = _block_tile(block_expert_ptr, inter, BN)
    if expert >= 0:
        w_row = (2 * expert, n0)  # the gate and up tiles' box in the [2E, I, K / 8] words
        args = (z_hi_ptr, z_lo_ptr, col_factor_ptr, s_ptr, w_desc, w_row, expert, sorted_ptr, act_ptr, blk * BM, n0,
                inter, K, row_scales, stride_se, top_k, beta, lin_beta)
        _by_valid_rows(_l1_fp8_rows, args, sorted_ptr, blk * BM, BM, BN, BK, NW, MMA)


@gluon.jit
def l2_fp8_kernel(a_hi_ptr, a_lo_ptr, row_factor_ptr, s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, latent, K,
                  row_scales, stride_se, w_desc, BM: gl.constexpr, BK: gl.constexpr, num_warps: gl.constexpr,
                  MMA: gl.constexpr = "pipe"):
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert = _block_tile(block_expert_ptr, latent, BN)
    if expert >= 0:
        args = (a_hi_ptr, a_lo_ptr, row_factor_ptr, s_ptr, w_desc, expert * latent + n0, expert, sorted_ptr, pairs_ptr,
                blk * BM, n0, latent, K, row_scales, stride_se)
        _by_valid_rows(_l2_fp8_rows, args, sorted_ptr, blk * BM, BM, BN, BK, NW, MMA)
