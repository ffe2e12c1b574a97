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
Shared tiles come first in the grid (their K is the longest); routed programs past the last used
block exit at once (the grid is a static bound, see moe_align.py). Integer arguments that change
with the batch are not specialised on, so one compiled kernel serves every M.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .numerics import round_to, situ
from .weight_tiles import weight_step


@triton.jit
def _dual_gemm(
    a_ptr, a_rows, a_valid, stride_a, K,
    wg_ptr, wu_ptr, sg_ptr, su_ptr, w_rows, w_mask, stride_w, stride_s, desc, row_g0, row_u0,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    a_base = a_ptr + a_rows[None, :] * stride_a
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_base + kk[:, None], mask=a_valid[None, :], other=0.0)
        acc_g = weight_step(wg_ptr, sg_ptr, w_rows, w_mask, k0, stride_w, stride_s, a, acc_g, desc, row_g0,
                            BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC)
        acc_u = weight_step(wu_ptr, su_ptr, w_rows, w_mask, k0, stride_w, stride_s, a, acc_u, desc, row_u0,
                            BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC)
    return acc_g, acc_u


@triton.jit
def _gemm(
    a_ptr, a_rows, a_valid, stride_a, K, w_ptr, s_ptr, w_rows, w_mask, stride_w, stride_s, desc, row0,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    a_base = a_ptr + a_rows[None, :] * stride_a
    for k0 in range(0, K, BK):
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


@triton.jit(do_not_specialize=["m_s", "n_shared_tiles", "tiles_n_r", "tiles_n_s"])
def l1_kernel(
    z_ptr, w13_ptr, w13s_ptr, sorted_ptr, block_expert_ptr, act_ptr, w13_desc,
    latent, inter, top_k, stride_we, stride_wn, stride_se, stride_sn,
    x_ptr, w1s_ptr, w3s_ptr, act_s_ptr, hidden, inter_s, m_s,
    n_shared_tiles, tiles_n_r, tiles_n_s, beta, lin_beta,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BNS: tl.constexpr, BKS: tl.constexpr, MXFP4: tl.constexpr,
    DEQUANT: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BM)
    if pid < n_shared_tiles:
        toks, valid, n, nmask = _shared_tile(pid, tiles_n_s, m_s, inter_s, BM, BNS)
        acc_g, acc_u = _dual_gemm(
            x_ptr, toks, valid, hidden, hidden, w1s_ptr, w3s_ptr, None, None, n, nmask, hidden, 0, None, 0, 0,
            BM, BNS, BKS, False, 0, INTERPRET, DOT_PREC, False,
        )
        dtype = act_s_ptr.dtype.element_ty
        g = round_to(acc_g, dtype, INTERPRET).to(tl.float32)
        u = round_to(acc_u, dtype, INTERPRET).to(tl.float32)
        act = round_to(situ(g, u, beta, lin_beta), dtype, INTERPRET)
        tl.store(act_s_ptr + toks[None, :] * inter_s + n[:, None], act, mask=valid[None, :] & nmask[:, None])
    else:
        q = pid - n_shared_tiles
        blk = q // tiles_n_r
        expert = tl.load(block_expert_ptr + blk)
        if expert >= 0:
            pos = blk * BM + cols
            pair = tl.load(sorted_ptr + pos)
            valid = pair >= 0
            tok = tl.where(valid, pair // top_k, 0)
            n = (q % tiles_n_r) * BN + tl.arange(0, BN)
            nmask = n < inter
            w_base = w13_ptr + expert.to(tl.int64) * stride_we
            s_base = w13s_ptr + expert.to(tl.int64) * stride_se
            acc_g, acc_u = _dual_gemm(
                z_ptr, tok, valid, latent, latent,
                w_base, w_base + inter * stride_wn, s_base, s_base + inter * stride_sn,
                n, nmask, stride_wn, stride_sn,
                w13_desc, expert * (2 * inter) + (q % tiles_n_r) * BN, expert * (2 * inter) + inter + (q % tiles_n_r) * BN,
                BM, BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC,
            )
            act = round_to(situ(acc_g, acc_u, beta, lin_beta), act_ptr.dtype.element_ty, INTERPRET)
            tl.store(act_ptr + pos[None, :] * inter + n[:, None], act, mask=nmask[:, None])


@triton.jit(do_not_specialize=["m_s", "n_shared_tiles", "tiles_n_r", "tiles_n_s"])
def l2_kernel(
    act_ptr, w2_ptr, w2s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, w2_desc,
    latent, inter, stride_we, stride_wn, stride_se, stride_sn,
    act_s_ptr, w2sh_ptr, ws_ptr, hidden, inter_s, m_s,
    n_shared_tiles, tiles_n_r, tiles_n_s,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BNS: tl.constexpr, BKS: tl.constexpr, MXFP4: tl.constexpr,
    DEQUANT: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BM)
    if pid < n_shared_tiles:
        toks, valid, n, nmask = _shared_tile(pid, tiles_n_s, m_s, hidden, BM, BNS)
        acc = _gemm(act_s_ptr, toks, valid, inter_s, inter_s, w2sh_ptr, None, n, nmask, inter_s, 0, None, 0,
                    BM, BNS, BKS, False, 0, INTERPRET, DOT_PREC, False)
        out = round_to(acc, ws_ptr.dtype.element_ty, INTERPRET)
        tl.store(ws_ptr + toks[None, :] * hidden + n[:, None], out, mask=valid[None, :] & nmask[:, None])
    else:
        q = pid - n_shared_tiles
        blk = q // tiles_n_r
        expert = tl.load(block_expert_ptr + blk)
        if expert >= 0:
            pos = blk * BM + cols
            n = (q % tiles_n_r) * BN + tl.arange(0, BN)
            nmask = n < latent
            acc = _gemm(
                act_ptr, pos, pos >= 0, inter, inter,
                w2_ptr + expert.to(tl.int64) * stride_we, w2s_ptr + expert.to(tl.int64) * stride_se,
                n, nmask, stride_wn, stride_sn, w2_desc, expert * latent + (q % tiles_n_r) * BN,
                BM, BN, BK, MXFP4, DEQUANT, INTERPRET, DOT_PREC, WDESC,
            )
            pair = tl.load(sorted_ptr + pos)
            dest = pairs_ptr + pair[None, :].to(tl.int64) * latent + n[:, None]
            tl.store(dest, acc, mask=(pair >= 0)[None, :] & nmask[:, None])
