"""Grouped expert GEMMs (routed experts + the shared expert as one more 'expert' in the same launch).

Tiles are computed transposed, out^T [BN, BM] = W[rows, :] @ A^T, so the weight is the left MMA
operand: decode has 1-16 tokens per expert, and the weight rows fill the MMA's wide side while a
dequantised MXFP4 tile can feed it straight from registers.

L1 (gate/up + SiTU): each program owns BN intermediate columns of one block of BM rows and keeps a
gate and an up accumulator. Routed rows gather z by token and keep h in FP32 (SiTU of the
unrounded h, act rounded once); shared rows round g and u to the activation dtype first, as the
unfused nn.Linear outputs are.
L2 (down): routed rows write out = act @ W2^T in FP32 per (token, slot) pair for the combine;
shared rows write round(act_s @ W2_s^T) straight into the fragment buffer.
The shared branch has its own tile (BNS x BKS): shared memory is sized for the larger branch, and
a BF16 shared tile as deep as an MXFP4 routed one would cap the CTAs per SM that MXFP4 dequant
needs for latency hiding. At decode the shared gate/up GEMM is only I_s / BNS programs long in K
= H: narrow, deeper shared tiles (BNS < BN) spread its weight stream over more SMs.
WDESC (GemmTiles.tma) reads the routed weight tiles through host-built tensor descriptors over
the weights' 2D view ([E * rows, K]; one bulk copy per tile, no per-element addresses) instead of
per-element pointers; scales and activations keep pointer loads (a scale tile of BK / 32 bytes per
row is below the copy engine's 16-byte minimum).
SPLIT (GemmTiles.split_k) cuts K into slices run by adjacent programs, for decode batches too small
to fill the GPU: L1 slices write FP32 gate/up partials (SiTU after their ordered sum in
split_k_finish.py), routed L2 slices write their own FP32 pair rows (summed by the combine).
Shared tiles come first in the grid (their K is the longest); routed programs past the last used
block exit at once (the grid is a static bound, see moe_align.py). Integer arguments that change
with the batch are not specialised on, so one compiled kernel serves every M.
LARGE_OFFSETS casts the token and row indices to int64 before they meet a stride: the launcher sets it where the
activation rows [blocks * BM, I] or another operand reach past int32 offsets (ops/common/element_offsets.py; the
FP32 pair rows and split-K partials are addressed in int64 always).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...common.triton_numerics import round_to, situ
from .weight_tiles import weight_step


@triton.jit
def _k_range(split, K, SPLIT: tl.constexpr, BK: tl.constexpr):
    """K slice [lo, hi) of split `split` of SPLIT: whole BK tiles, the last slice possibly shorter or empty."""
    chunk = tl.cdiv(K, SPLIT * BK) * BK
    lo = split * chunk
    return lo, tl.minimum(K, lo + chunk)


@triton.jit
def _dual_gemm(
    a_ptr, a_rows, a_valid, stride_a, k_lo, k_hi,
    wg_ptr, wu_ptr, sg_ptr, su_ptr, w_rows, w_mask, stride_w, stride_s, desc, row_g0, row_u0,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    a_base = a_ptr + a_rows[None, :] * stride_a
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_base + kk[:, None], mask=a_valid[None, :], other=0.0)
        acc_g = weight_step(wg_ptr, sg_ptr, w_rows, w_mask, k0, stride_w, stride_s, a, acc_g, desc, row_g0,
                            BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC)
        acc_u = weight_step(wu_ptr, su_ptr, w_rows, w_mask, k0, stride_w, stride_s, a, acc_u, desc, row_u0,
                            BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC)
    return acc_g, acc_u


@triton.jit
def _gemm(
    a_ptr, a_rows, a_valid, stride_a, k_lo, k_hi, w_ptr, s_ptr, w_rows, w_mask, stride_w, stride_s, desc, row0,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    a_base = a_ptr + a_rows[None, :] * stride_a
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_base + kk[:, None], mask=a_valid[None, :], other=0.0)
        acc = weight_step(w_ptr, s_ptr, w_rows, w_mask, k0, stride_w, stride_s, a, acc, desc, row0,
                          BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC)
    return acc


@triton.jit
def _shared_tile(pid, tiles_n, m_s, n_total, BM: tl.constexpr, BNS: tl.constexpr):
    """Shared-expert program pid: its BM token rows and BNS output columns, with their masks."""
    toks = (pid // tiles_n) * BM + tl.arange(0, BM)
    n = (pid % tiles_n) * BNS + tl.arange(0, BNS)
    return toks, toks < m_s, n, n < n_total


@triton.jit
def _store_gate_up(part_ptr, split, n_rows, rows, row_mask, n, nmask, width, acc_g, acc_u):
    """Split-K partials: FP32 gate and up sums of one K slice into part [SPLIT, n_rows, 2 * width]."""
    base = part_ptr + (split * n_rows + rows[None, :]).to(tl.int64) * (2 * width) + n[:, None]
    mask = row_mask[None, :] & nmask[:, None]
    tl.store(base, acc_g, mask=mask)
    tl.store(base + width, acc_u, mask=mask)


@triton.jit(do_not_specialize=["m_s", "n_shared_tiles", "tiles_n_r", "tiles_n_s", "n_rows_r"])
def l1_kernel(
    z_ptr, w13_ptr, w13s_ptr, sorted_ptr, block_expert_ptr, act_ptr, w13_desc,
    latent, inter, top_k, stride_we, stride_wn, stride_se, stride_sn,
    x_ptr, w1s_ptr, w3s_ptr, act_s_ptr, hidden, inter_s, m_s,
    n_shared_tiles, tiles_n_r, tiles_n_s, beta, lin_beta, h_part_ptr, hs_part_ptr, n_rows_r,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BNS: tl.constexpr, BKS: tl.constexpr, MXFP4: tl.constexpr,
    DEQUANT: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
    SPLIT: tl.constexpr, LARGE_OFFSETS: tl.constexpr = False,
):
    # With SPLIT > 1 each tile's K is cut into SPLIT slices (adjacent programs); they write FP32 gate/up
    # partials and split_k.l1_finish_kernel applies SiTU to their ordered sum.
    split = tl.program_id(0) % SPLIT
    pid = tl.program_id(0) // SPLIT
    cols = tl.arange(0, BM)
    if LARGE_OFFSETS:
        cols = cols.to(tl.int64)
    if pid < n_shared_tiles:
        toks, valid, n, nmask = _shared_tile(pid, tiles_n_s, m_s, inter_s, BM, BNS)
        if LARGE_OFFSETS:
            toks = toks.to(tl.int64)
        k_lo, k_hi = _k_range(split, hidden, SPLIT, BKS)
        acc_g, acc_u = _dual_gemm(
            x_ptr, toks, valid, hidden, k_lo, k_hi, w1s_ptr, w3s_ptr, None, None, n, nmask, hidden, 0, None, 0, 0,
            BM, BNS, BKS, False, 0, INTERPRET, DOT_PREC, False,
        )
        if SPLIT == 1:
            dtype = act_s_ptr.dtype.element_ty
            g = round_to(acc_g, dtype, INTERPRET).to(tl.float32)
            u = round_to(acc_u, dtype, INTERPRET).to(tl.float32)
            act = round_to(situ(g, u, beta, lin_beta), dtype, INTERPRET)
            tl.store(act_s_ptr + toks[None, :] * inter_s + n[:, None], act, mask=valid[None, :] & nmask[:, None])
        else:
            _store_gate_up(hs_part_ptr, split, m_s, toks, valid, n, nmask, inter_s, acc_g, acc_u)
    else:
        q = pid - n_shared_tiles
        blk = q // tiles_n_r
        expert = tl.load(block_expert_ptr + blk)
        if expert >= 0:
            pos = blk * BM + cols
            pair = tl.load(sorted_ptr + pos)
            valid = pair >= 0
            tok = tl.where(valid, pair // top_k, 0)
            if LARGE_OFFSETS:
                tok = tok.to(tl.int64)
            n = (q % tiles_n_r) * BN + tl.arange(0, BN)
            nmask = n < inter
            w_base = w13_ptr + expert.to(tl.int64) * stride_we
            s_base = w13s_ptr + expert.to(tl.int64) * stride_se
            k_lo, k_hi = _k_range(split, latent, SPLIT, BK)
            acc_g, acc_u = _dual_gemm(
                z_ptr, tok, valid, latent, k_lo, k_hi,
                w_base, w_base + inter * stride_wn, s_base, s_base + inter * stride_sn,
                n, nmask, stride_wn, stride_sn,
                w13_desc, expert * (2 * inter) + (q % tiles_n_r) * BN, expert * (2 * inter) + inter + (q % tiles_n_r) * BN,
                BM, BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC,
            )
            if SPLIT == 1:
                act = round_to(situ(acc_g, acc_u, beta, lin_beta), act_ptr.dtype.element_ty, INTERPRET)
                tl.store(act_ptr + pos[None, :] * inter + n[:, None], act, mask=nmask[:, None])
            else:
                _store_gate_up(h_part_ptr, split, n_rows_r, pos, pos >= 0, n, nmask, inter, acc_g, acc_u)


@triton.jit(do_not_specialize=["m_s", "n_shared_tiles", "tiles_n_r", "tiles_n_s", "num_pairs"])
def l2_kernel(
    act_ptr, w2_ptr, w2s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, w2_desc,
    latent, inter, stride_we, stride_wn, stride_se, stride_sn,
    act_s_ptr, w2sh_ptr, ws_ptr, hidden, inter_s, m_s,
    n_shared_tiles, tiles_n_r, tiles_n_s, num_pairs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BNS: tl.constexpr, BKS: tl.constexpr, MXFP4: tl.constexpr,
    DEQUANT: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
    SPLIT: tl.constexpr, LARGE_OFFSETS: tl.constexpr = False,
):
    # SPLIT > 1 cuts the routed tiles' K into SPLIT slices (adjacent programs), each writing its own
    # FP32 pair rows (pairs [SPLIT, num_pairs, L]) that the combine sums in slice order. The shared
    # tiles (K = I_s, short) are not split: their rounded result goes straight to the fragments.
    pid = tl.program_id(0)
    cols = tl.arange(0, BM)
    if LARGE_OFFSETS:
        cols = cols.to(tl.int64)
    if pid < n_shared_tiles:
        toks, valid, n, nmask = _shared_tile(pid, tiles_n_s, m_s, hidden, BM, BNS)
        if LARGE_OFFSETS:
            toks = toks.to(tl.int64)
        acc = _gemm(act_s_ptr, toks, valid, inter_s, 0, inter_s, w2sh_ptr, None, n, nmask, inter_s, 0, None, 0,
                    BM, BNS, BKS, False, 0, INTERPRET, DOT_PREC, False)
        out = round_to(acc, ws_ptr.dtype.element_ty, INTERPRET)
        tl.store(ws_ptr + toks[None, :] * hidden + n[:, None], out, mask=valid[None, :] & nmask[:, None])
    else:
        split = (pid - n_shared_tiles) % SPLIT
        q = (pid - n_shared_tiles) // SPLIT
        blk = q // tiles_n_r
        expert = tl.load(block_expert_ptr + blk)
        if expert >= 0:
            pos = blk * BM + cols
            n = (q % tiles_n_r) * BN + tl.arange(0, BN)
            nmask = n < latent
            k_lo, k_hi = _k_range(split, inter, SPLIT, BK)
            acc = _gemm(
                act_ptr, pos, pos >= 0, inter, k_lo, k_hi,
                w2_ptr + expert.to(tl.int64) * stride_we, w2s_ptr + expert.to(tl.int64) * stride_se,
                n, nmask, stride_wn, stride_sn, w2_desc, expert * latent + (q % tiles_n_r) * BN,
                BM, BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC,
            )
            pair = tl.load(sorted_ptr + pos)
            dest = pairs_ptr + (split * num_pairs + pair[None, :]).to(tl.int64) * latent + n[:, None]
            tl.store(dest, acc, mask=(pair >= 0)[None, :] & nmask[:, None])
