"""Routed MXFP4 expert GEMMs for prefill blocks (128 rows, sm_90): the weights dequantised once per program into
shared memory, both wgmma operands from shared memory, the MMA asynchronous.

The register-dequant kernels (routed_gemm.py) feed each dequantised tile to a synchronous wgmma from registers and
stage the activation tile through registers (loads, permutes, shared stores): fine at decode, where the weight bytes
bound them, but at prefill they reach a third of the BF16 rate (bench/results/prefill_regs.md) and a wider MMA there
was slower (docs/design/prefill.md: every thread then stages more activations). Here, per 64-wide
k step:

- the weight words of the program's BN rows arrive by TMA through a ring of 4 stages (3 steps ahead);
- the activation rows [BM, BK] go straight to shared memory by cp.async (2 steps ahead, 4 buffers): no registers,
  no permutation (both operands keep the weights' own k order, so no kappa order either);
- every thread dequantises 4 words (32 k of one row, one E8M0 scale) with lut_dequant's bit placement and stores
  them to a [BN, 64] tile (2 buffers) in 16-byte stores;
- one CTA barrier, then the wgmma of the step is issued asynchronously and the step before's is waited for: the
  tensor cores run step i while the threads dequantise step i + 1.

Buffer reuse: a step's activation buffer is refilled (for step i + 4) after the barrier of step i + 2, which every
warp group passes only after its wait for wgmma i; its weight tile is rewritten at step i + 2 by the warp group whose
wgmma reads those rows, after that group's own wait for wgmma i. With 112 KB of shared memory and at most 128
registers, two CTAs of 8 warps share an SM (gluon.STAGED_MAX_REGISTERS).

L1: BN = 128 weight rows, the gate rows n0 .. n0 + 64 then the same columns' up rows (one 3-d TMA box), SiTU in the
epilogue. L2: BN = 128 rows of W2, FP32 pair rows out. Both take 128-row expert blocks and run the MMA with N = 64
on blocks with at most 64 valid rows. The FP32 sums group k differently from the register kernels (natural k order
in 16-wide MMA chunks against kappa order): same values to FP32 rounding, not the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...common.gdc import wait_own_copies_0, wait_own_copies_1
from ...common.triton_compat import cta_barrier
from ...common.triton_numerics import situ
from .lut_dequant import WINDOW_SCALE, codes_to_bf16, kappa_position, scale_factors
from .ring_loops import _ring_coord
from .routed_gemm import _program_tile, _valid_rows, store_pair_rows

_UNWINDOW = gl.constexpr(WINDOW_SCALE)
RING: gl.constexpr = gl.constexpr(4)  # stages of every ring; the k loop is unrolled by it (separate allocations)


@gluon.constexpr_function
def _words_layout(BN, NW):
    """int32 words [BN, 8] of one 64-wide k step: a thread holds 4 consecutive words (32 k, one scale) of a row."""
    return gl.BlockedLayout([1, 4], [16, 2], [NW, 1], [1, 0])


@gluon.constexpr_function
def _act_layout(NW):
    """[rows, 64] bf16 activation chunks: 8 consecutive k (16 bytes, one cp.async) per thread."""
    return gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])


@gluon.jit
def _dequant_tile(words, scales, BN: gl.constexpr):
    """int32 words [BN, 8] (8 codes each) and their E8M0 bytes -> [BN, 64] bf16 in k order, times 2^-WINDOW."""
    o0, o1, o2, o3, o4, o5, o6, o7 = codes_to_bf16(words, scale_factors(scales.to(gl.int32)))
    # Each join adds an innermost dimension: [BN, word, c0, c1, c2] for code c = 4 c2 + 2 c1 + c0.
    codes = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
    return gl.reshape(gl.permute(codes, [0, 1, 4, 3, 2]), [BN, 64])  # k = 8 word + code


@gluon.jit
def _copy_act(buf, a_rows, a_mask, k, live, NW: gl.constexpr):
    """The activation chunk of one k step into buf by cp.async (zeros for rows without a pair or a dead step)."""
    ak = gl.arange(0, 64, layout=gl.SliceLayout(0, _act_layout(NW)))
    async_copy.async_copy_global_to_shared(buf, a_rows + (k + ak)[None, :], mask=a_mask & live)
    async_copy.commit_group()


@gluon.jit
def _staged_step(u: gl.constexpr, i, n_steps, ws, rs, wts, acts, w_desc, w_row, s_ptrs, sc, a_rows, a_mask, acc,
                 GATED: gl.constexpr, BN: gl.constexpr, ROWS: gl.constexpr, NW: gl.constexpr):
    k = i * 64
    mbarrier.wait(rs[u], (i // RING) & 1)
    stage = ws[u]
    if GATED:
        stage = stage._reinterpret(gl.int32, [BN, 8],
                                   gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    words = stage.load(_words_layout(BN, NW))
    sc_next = gl.load(s_ptrs + (gl.minimum(i + 1, n_steps - 1) * 64) // 32)
    wts[u % 2].store(_dequant_tile(words, sc, BN))
    wait_own_copies_1()  # this thread's activation copies of step i (step i + 1's may still fly)
    fence_async_shared()  # the tile's stores (generic proxy) before the wgmma's reads (async proxy)
    # Every thread's tile stores and activation copies of step i are in; every warp group has waited for the wgmma
    # of step i - 2 and read stage u - 1 (their last uses of the buffers refilled below).
    cta_barrier()
    _copy_act(acts[(u + 2) % RING], a_rows, a_mask, k + 128, i + 2 < n_steps, NW)
    refill = i + RING - 1
    prev: gl.constexpr = (u + RING - 1) % RING
    tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, refill * 64, GATED), rs[prev], ws[prev],
                                    pred=(i >= 1) & (refill < n_steps))
    mbarrier.expect(rs[u], w_desc.block_type.nbytes, pred=i + RING < n_steps)
    acc = warpgroup_mma(wts[u % 2], acts[u].permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    return sc_next, acc


@gluon.jit
def _staged_mainloop(w_desc, w_row, s_ptrs, a_rows, a_mask, K, GATED: gl.constexpr, BN: gl.constexpr,
                     ROWS: gl.constexpr, NW: gl.constexpr):
    """acc [BN, ROWS] = W_tile @ act^T over K (FP32, times 2^WINDOW undone); a_rows [ROWS, 1] row pointers."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    op_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # Every buffer its own allocation: the compiler's barrier analysis tells separate allocations apart (views of
    # one alias in its eyes, even at constant indices, and would cost a CTA barrier per conflicting pair).
    w_shape: gl.constexpr = w_desc.block_type.shape
    ws = (gl.allocate_shared_memory(w_desc.dtype, w_shape, w_desc.layout),
          gl.allocate_shared_memory(w_desc.dtype, w_shape, w_desc.layout),
          gl.allocate_shared_memory(w_desc.dtype, w_shape, w_desc.layout),
          gl.allocate_shared_memory(w_desc.dtype, w_shape, w_desc.layout))
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    rs = (gl.allocate_shared_memory(gl.int64, [1], bar_l), gl.allocate_shared_memory(gl.int64, [1], bar_l),
          gl.allocate_shared_memory(gl.int64, [1], bar_l), gl.allocate_shared_memory(gl.int64, [1], bar_l))
    # Two weight tiles: each warp group dequantises the rows its own wgmma reads, so the tile it rewrites at step i
    # was last read by its wgmma of step i - 2, which its own wait of step i - 1 saw complete.
    wts = (gl.allocate_shared_memory(gl.bfloat16, [BN, 64], op_l), gl.allocate_shared_memory(gl.bfloat16, [BN, 64], op_l))
    acts = (gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], op_l),
            gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], op_l),
            gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], op_l),
            gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], op_l))
    n_steps = K // 64
    for st in gl.static_range(RING):
        mbarrier.init(rs[st], count=1)
    for st in gl.static_range(RING):
        mbarrier.expect(rs[st], w_desc.block_type.nbytes, pred=st < n_steps)
        tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, st * 64, GATED), rs[st], ws[st], pred=st < n_steps)
    _copy_act(acts[0], a_rows, a_mask, 0, n_steps > 0, NW)
    _copy_act(acts[1], a_rows, a_mask, 64, n_steps > 1, NW)
    sc = gl.load(s_ptrs)
    acc = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    for i0 in range(0, n_steps, RING):
        for u in gl.static_range(RING):
            sc, acc = _staged_step(u, i0 + u, n_steps, ws, rs, wts, acts, w_desc, w_row, s_ptrs, sc, a_rows, a_mask,
                                   acc, GATED, BN, ROWS, NW)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    wait_own_copies_0()  # the dead steps' copies, before the buffers go
    return acc * _UNWINDOW


@gluon.jit
def _scale_ptrs(s_ptr, expert, rows, row_scales, stride_se, BN: gl.constexpr, NW: gl.constexpr):
    """Scale-byte pointers [BN, 8] for k = 0 of the words layout (a thread's 4 words share one byte)."""
    words_l: gl.constexpr = _words_layout(BN, NW)
    rj = gl.arange(0, 8, layout=gl.SliceLayout(0, words_l))
    return s_ptr + expert.to(gl.int64) * stride_se + rows[:, None].to(gl.int64) * row_scales + (rj // 4)[None, :]


@gluon.jit
def _l1_rows(z_ptr, s_ptrs, w_desc, w_row, sorted_ptr, act_ptr, row0, n0, inter, K, top_k, beta, lin_beta,
             ROWS: gl.constexpr, NW: gl.constexpr):
    act_l: gl.constexpr = _act_layout(NW)
    pair = gl.load(sorted_ptr + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l)))
    tok = gl.where(pair >= 0, pair // top_k, 0)
    a_rows = (z_ptr + tok.to(gl.int64) * K)[:, None]
    a_mask = (pair >= 0)[:, None]
    BN: gl.constexpr = 16 * NW
    acc = _staged_mainloop(w_desc, w_row, s_ptrs, a_rows, a_mask, K, True, BN, ROWS, NW)
    store_situ_rows(acc, act_ptr, row0, n0, inter, beta, lin_beta, ROWS, NW)


@gluon.jit
def store_situ_rows(acc, act_ptr, row0, n0, inter, beta, lin_beta, ROWS: gl.constexpr, NW: gl.constexpr,
                    KAPPA: gl.constexpr = False):
    """L1's epilogue for 128 weight rows: acc [16 NW, ROWS] holds the gate rows of columns n0 .. n0 + 8 NW, then the
    same columns' up rows; act[row0 .. row0 + ROWS, those columns] = bf16(SiTU(gate, up)), each column at its kappa
    position if KAPPA (the kappa kernels' act, which their L2 reads as it is)."""
    HALF: gl.constexpr = 8 * NW
    # a layout in which a thread holds row c and row c + HALF pairs them in its registers (convert_layout goes
    # through shared memory once per program)
    pair_l: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32, 1], [1, 1, NW], [1, 0, 2])
    both = gl.convert_layout(gl.reshape(acc, [2, HALF, ROWS]), pair_l)
    g, u = gl.split(gl.permute(both, [1, 2, 0]))
    out_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, NW], [0, 1])
    g = gl.convert_layout(g, out_l, assert_trivial=True)
    u = gl.convert_layout(u, out_l, assert_trivial=True)
    h = situ(g, u, beta, lin_beta)
    on = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, out_l))
    if KAPPA:
        on = kappa_position(on)
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, out_l))
    gl.store(act_ptr + om[None, :].to(gl.int64) * inter + on[:, None], h.to(act_ptr.dtype.element_ty))


@gluon.jit(do_not_specialize=["top_k"])
def l1_staged_kernel(z_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K, row_scales, top_k, stride_se,
                     beta, lin_beta, w_desc, BM: gl.constexpr, num_warps: gl.constexpr):
    """act[block rows, n0 .. n0 + BN/2] = bf16(SiTU(gate, up)); one program per (block, BN/2 columns)."""
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    HALF: gl.constexpr = BN // 2
    blk, n0, expert, _ = _program_tile(block_expert_ptr, inter, HALF, 1)
    if expert >= 0:
        rn = gl.arange(0, BN, layout=gl.SliceLayout(1, _words_layout(BN, NW)))
        rows = gl.where(rn < HALF, n0 + rn, inter + n0 + rn - HALF)
        s_ptrs = _scale_ptrs(s_ptr, expert, rows, row_scales, stride_se, BN, NW)
        args = (z_ptr, s_ptrs, w_desc, (2 * expert, n0), sorted_ptr, act_ptr, blk * BM, n0, inter, K, top_k, beta,
                lin_beta)
        if _valid_rows(sorted_ptr, blk * BM, BM, NW) <= BM // 2:
            _l1_rows(*args, BM // 2, NW)
        else:
            _l1_rows(*args, BM, NW)


@gluon.jit
def _l2_rows(act_ptr, s_ptrs, w_desc, w_row, sorted_ptr, pairs_ptr, row0, n0, latent, K, ROWS: gl.constexpr,
             NW: gl.constexpr):
    act_l: gl.constexpr = _act_layout(NW)
    am = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    a_rows = (act_ptr + am.to(gl.int64) * K)[:, None]
    a_mask = (gl.load(sorted_ptr + am) >= 0)[:, None]
    BN: gl.constexpr = 16 * NW
    acc = _staged_mainloop(w_desc, w_row, s_ptrs, a_rows, a_mask, K, False, BN, ROWS, NW)
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    store_pair_rows(acc, pairs_ptr, sorted_ptr, row0, n0, latent, mma_l, ROWS, BN)


@gluon.jit
def l2_staged_kernel(act_ptr, s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, latent, K, row_scales, stride_se,
                     w_desc, BM: gl.constexpr, num_warps: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T (FP32) for the valid rows of each block."""
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert, _ = _program_tile(block_expert_ptr, latent, BN, 1)
    if expert >= 0:
        rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, _words_layout(BN, NW)))
        s_ptrs = _scale_ptrs(s_ptr, expert, rows, row_scales, stride_se, BN, NW)
        args = (act_ptr, s_ptrs, w_desc, expert * latent + n0, sorted_ptr, pairs_ptr, blk * BM, n0, latent, K)
        if _valid_rows(sorted_ptr, blk * BM, BM, NW) <= BM // 2:
            _l2_rows(*args, BM // 2, NW)
        else:
            _l2_rows(*args, BM, NW)
