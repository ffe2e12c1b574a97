"""Routed MXFP4 expert GEMMs for decode with the dequantised weights fed to wgmma from registers.

Same schedule and outputs as triton_kernels/expert_gemm.py for blocks of BM = 16 or 32 (token, slot)
rows: out^T [BN, BM] = W[e, rows, :] @ act^T, the weight the left operand. The Triton kernels stage
every dequantised tile through shared memory before the MMA (load -> dequant -> store -> barrier ->
wgmma, latency-bound: bench/results/producer_notes.md, run 5). Here each thread loads the 16
contiguous bytes of its own fragment (lut_dequant.py: the MMA's k order is permuted so that this holds
for the standard layout), expands them in registers and issues the wgmma with A from registers;
only the small activation tile [BM, 128] goes through shared memory (double-buffered, stored in the
permuted order). The next step's weights are loaded before the current one is expanded.

L1 (gate and up, two accumulators, SiTU of the FP32 sums, act rounded once) and L2 (down, FP32 pair
rows for the combine) as in the Triton kernels; shared-expert tiles are not handled here.

SPLIT > 1 cuts K into SPLIT slices for a single decode token, whose ~2 local experts
give too few programs to keep enough loads in flight: L1 then writes FP32 gate and up slice sums
(triton_kernels/split_k.py adds them in slice order and applies SiTU), L2 writes FP32 slice rows
that the combine adds in slice order. Both are bitwise the same on every run.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma

from ..triton_kernels.gdc import (
    prefetch_rows_l2,
    release_dependents,
    wait_for_predecessor,
    wait_own_copies_0,
    wait_own_copies_2,
)
from ..triton_kernels.numerics import situ
from .lut_dequant import WINDOW_SCALE, dequant_kappa, to_kappa

# dequant_kappa gives the weights times 2^-WINDOW (lut_dequant.py): the FP32 sums are scaled back, exactly.
_UNWINDOW = gl.constexpr(WINDOW_SCALE)

# Launch settings (k step, warps per kernel, block rows) live in __init__.py.


@gluon.constexpr_function
def _words_layout(BN, BK, NW):
    """int32 words [BN, BK/8]: thread q of a row holds words 4q .. 4q + 3 (16 bytes) and its rows are
    lane / 4 + {0, 8} of its warp's 16."""
    warp_bases = [[16, 0], [32, 0]] if NW == 4 else [[16, 0], [32, 0], [64, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_bases, block_bases=[], shape=[BN, BK // 8])


@gluon.jit
def _weight_ptrs(w_ptr, s_ptr, expert, row0, row_words, row_scales, stride_we, stride_se,
                 BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """Pointers to the int32 words [BN, BK/8] (one 16-byte load per thread and row) and their scale
    bytes for k = 0."""
    words_l: gl.constexpr = _words_layout(BN, BK, NW)
    rn = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, words_l))
    rj = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, words_l))
    e = expert.to(gl.int64)
    w_ptrs = w_ptr + e * stride_we + rn[:, None] * row_words + rj[None, :]
    s_ptrs = s_ptr + e * stride_se + rn[:, None] * row_scales + (rj // 4)[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def _step(wd, sc, wd2, sc2, act, buf, acc, acc2, DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
          BK: gl.constexpr, NW: gl.constexpr):
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    buf.store(to_kappa(act, BM, BK))
    fence_async_shared()
    # One barrier per step: a buffer is rewritten two steps later, after every warp passed the next
    # step's barrier and so finished this step's (synchronous) wgmma.
    gl.thread_barrier()
    a_reg = gl.convert_layout(dequant_kappa(wd, sc.to(gl.int32), BN, BK), a_l, assert_trivial=True)
    acc = warpgroup_mma(a_reg, buf.permute((1, 0)), acc)
    if DUAL:
        a_reg2 = gl.convert_layout(dequant_kappa(wd2, sc2.to(gl.int32), BN, BK), a_l, assert_trivial=True)
        acc2 = warpgroup_mma(a_reg2, buf.permute((1, 0)), acc2)
    return acc, acc2


@gluon.jit
def _load_step(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k, DUAL: gl.constexpr):
    """One k step's operands: weight words and scales (and the second tile's if DUAL), activation tile."""
    wd = gl.load(w_ptrs + k // 8)
    sc = gl.load(s_ptrs + k // 32)
    wd2 = wd
    sc2 = sc
    if DUAL:
        wd2 = gl.load(w2_ptrs + k // 8)
        sc2 = gl.load(s2_ptrs + k // 32)
    return wd, sc, wd2, sc2, gl.load(a_ptrs + k, mask=a_mask, other=0.0)


@gluon.jit
def _mainloop(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """acc (and acc2 if DUAL) [BN, BM] in FP32 over k_begin .. k_end; the next step's loads are issued first."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BK], b_sl)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    acc2 = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    wd, sc, wd2, sc2, act = _load_step(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, DUAL)
    i = 0
    for k0 in range(k_begin, k_end, BK):
        k_nx = gl.multiple_of(gl.minimum(k0 + BK, k_end - BK), BK)  # the last step reloads itself
        wd_nx, sc_nx, wd2_nx, sc2_nx, act_nx = _load_step(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_nx, DUAL)
        acc, acc2 = _step(wd, sc, wd2, sc2, act, b_smem.index(i % 2), acc, acc2, DUAL, BM, BN, BK, NW)
        wd, sc, wd2, sc2, act = wd_nx, sc_nx, wd2_nx, sc2_nx, act_nx
        i += 1
    return acc, acc2


@gluon.jit
def _load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k, DUAL: gl.constexpr):
    """One k step's scale bytes (and the second tile's if DUAL) and activation tile (the ring's weights
    arrive by TMA)."""
    sc = gl.load(s_ptrs + k // 32)
    sc2 = sc
    if DUAL:
        sc2 = gl.load(s2_ptrs + k // 32)
    return sc, sc2, gl.load(a_ptrs + k, mask=a_mask, other=0.0)


@gluon.jit
def _alloc_ring(w_desc, STAGES: gl.constexpr):
    """STAGES weight stages (the descriptor's box each) and their ready barriers, every one its own
    allocation: the compiler's barrier analysis tells separate allocations apart, while views of one
    allocation alias in its eyes, even at constant indices (one extra CTA barrier per conflict)."""
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    w0 = gl.allocate_shared_memory(w_desc.dtype, w_desc.block_type.shape, w_desc.layout)
    w1 = gl.allocate_shared_memory(w_desc.dtype, w_desc.block_type.shape, w_desc.layout)
    w2 = gl.allocate_shared_memory(w_desc.dtype, w_desc.block_type.shape, w_desc.layout)
    w3 = gl.allocate_shared_memory(w_desc.dtype, w_desc.block_type.shape, w_desc.layout)
    r0 = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    r1 = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    r2 = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    r3 = gl.allocate_shared_memory(gl.int64, [1], bar_l)
    return (w0, w1, w2, w3), (r0, r1, r2, r3)


@gluon.jit
def _ring_coord(w_row, k, DUAL: gl.constexpr):
    """The box's coordinates: L1 [2 * expert (gate; up next), row, word], L2 [expert * rows + row, word]."""
    if DUAL:
        coord = [w_row[0], w_row[1], k // 8]
    else:
        coord = [w_row, k // 8]
    return coord


@gluon.jit
def _tile_words(stage, t: gl.constexpr, DUAL: gl.constexpr, layout: gl.constexpr):
    """Tile t's words [BN, BK/8] of a stage: L1's stages hold [gate, up] (one 3-d box), L2's one tile."""
    if DUAL:
        rows: gl.constexpr = stage.shape[1]
        flat = stage._reinterpret(gl.int32, [2 * rows, stage.shape[2]],
                                  gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
        words = flat.slice(t * rows, rows).load(layout)
    else:
        words = stage.load(layout)
    return words


@gluon.jit
def _tma_step(u: gl.constexpr, i, ws, rs, bs, w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, n_steps,
              sc, sc2, act, acc, acc2, DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              NW: gl.constexpr):
    STAGES: gl.constexpr = 4
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    words_l: gl.constexpr = _words_layout(BN, BK, NW)
    k_nx = gl.multiple_of(gl.minimum(k_begin + (i + 1) * BK, k_end - BK), BK)  # the last step reloads itself
    sc_nx, sc2_nx, act_nx = _load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_nx, DUAL)
    mbarrier.wait(rs[u], (i // STAGES) & 1)
    wd = _tile_words(ws[u], 0, DUAL, words_l)
    wd2 = wd
    if DUAL:
        wd2 = _tile_words(ws[u], 1, DUAL, words_l)
    buf = bs[u % 2]
    buf.store(to_kappa(act, BM, BK))
    # Orders this thread's activation stores and its reads of the stage before the async-proxy accesses
    # after the barrier (the wgmma's read of the activation tile, the stage's refill).
    fence_async_shared()
    # The one barrier per step: the activation tile is complete, every warp has read stage u - 1 (which
    # now takes step i + 3; armed one step ago) and waited on stage u (armed now for step i + 4, filled
    # next step). Every other pair of conflicting accesses is on separate allocations.
    gl.thread_barrier()
    prev: gl.constexpr = (u + STAGES - 1) % STAGES
    refill = i + STAGES - 1
    tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, k_begin + refill * BK, DUAL), rs[prev], ws[prev],
                                    pred=(i >= 1) & (refill < n_steps))
    mbarrier.expect(rs[u], w_desc.block_type.nbytes, pred=i + STAGES < n_steps)
    a_reg = gl.convert_layout(dequant_kappa(wd, sc.to(gl.int32), BN, BK), a_l, assert_trivial=True)
    acc = warpgroup_mma(a_reg, buf.permute((1, 0)), acc)
    if DUAL:
        a_reg2 = gl.convert_layout(dequant_kappa(wd2, sc2.to(gl.int32), BN, BK), a_l, assert_trivial=True)
        acc2 = warpgroup_mma(a_reg2, buf.permute((1, 0)), acc2)
    return sc_nx, sc2_nx, act_nx, acc, acc2


@gluon.jit
def _mainloop_tma(w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """_mainloop with the weight words streamed by TMA through a ring of 4 shared-memory stages (3 k
    steps ahead per program, independent of registers) instead of 16-byte loads one step ahead. Unrolled
    by 4, every stage and barrier its own allocation: one CTA barrier per step. The K range must hold a
    whole number of rounds (the launcher takes the loads otherwise: a guarded last round costs registers
    and time in the whole kernel, bench/results/routed_ring.md)."""
    STAGES: gl.constexpr = 4
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    bs = (gl.allocate_shared_memory(gl.bfloat16, [BM, BK], b_sl), gl.allocate_shared_memory(gl.bfloat16, [BM, BK], b_sl))
    ws, rs = _alloc_ring(w_desc, STAGES)
    for st in gl.static_range(STAGES):
        mbarrier.init(rs[st], count=1)
    n_steps = (k_end - k_begin) // BK
    for st in gl.static_range(STAGES):
        mbarrier.expect(rs[st], w_desc.block_type.nbytes, pred=st < n_steps)
        tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, k_begin + st * BK, DUAL), rs[st], ws[st],
                                        pred=st < n_steps)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    acc2 = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    sc, sc2, act = _load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, DUAL)
    for i0 in range(0, n_steps, STAGES):
        for u in gl.static_range(STAGES):
            sc, sc2, act, acc, acc2 = _tma_step(u, i0 + u, ws, rs, bs, w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask,
                                                k_begin, k_end, n_steps, sc, sc2, act, acc, acc2, DUAL, BM, BN, BK, NW)
    return acc, acc2


@gluon.jit
def _copy_words(dest, w_ptrs, k, live):
    """This thread's 16-byte weight chunks of one k step into a ring stage (cp.async; zeros where not live)."""
    async_copy.async_copy_global_to_shared(dest, w_ptrs + k // 8, mask=live)


@gluon.jit
def _cp_step(u: gl.constexpr, i, ws, ws2, bs, w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, n_steps,
             sc, sc2, act, acc, acc2, DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             BK: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    words_l: gl.constexpr = _words_layout(BN, BK, NW)
    k_nx = gl.multiple_of(gl.minimum(k_begin + (i + 1) * BK, k_end - BK), BK)  # the last step reloads itself
    sc_nx, sc2_nx, act_nx = _load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_nx, DUAL)
    if STAGES == 2:  # this thread's copies of step i have landed
        wait_own_copies_0()
    else:
        wait_own_copies_2()
    buf = bs[u % 2]
    buf.store(to_kappa(act, BM, BK))
    fence_async_shared()
    # One barrier per step: the activation tile is complete, and every warp has read the stage that step
    # i - 1 used (each thread reads back only its own copies, but the compiler's barrier analysis cannot
    # see that), which now takes step i + STAGES - 1.
    gl.thread_barrier()
    nxt = i + STAGES - 1
    live = gl.full([BN, BK // 8], nxt, gl.int32, layout=words_l) < n_steps
    k_fill = k_begin + gl.minimum(nxt, n_steps - 1) * BK
    _copy_words(ws[(u + STAGES - 1) % STAGES], w_ptrs, k_fill, live)
    if DUAL:
        _copy_words(ws2[(u + STAGES - 1) % STAGES], w2_ptrs, k_fill, live)
    async_copy.commit_group()
    wd = ws[u].load(words_l)
    a_reg = gl.convert_layout(dequant_kappa(wd, sc.to(gl.int32), BN, BK), a_l, assert_trivial=True)
    acc = warpgroup_mma(a_reg, buf.permute((1, 0)), acc)
    if DUAL:
        wd2 = ws2[u].load(words_l)
        a_reg2 = gl.convert_layout(dequant_kappa(wd2, sc2.to(gl.int32), BN, BK), a_l, assert_trivial=True)
        acc2 = warpgroup_mma(a_reg2, buf.permute((1, 0)), acc2)
    return sc_nx, sc2_nx, act_nx, acc, acc2


@gluon.jit
def _alloc_stages(BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """STAGES separate [BN, BK/8] int32 buffers: one allocation each, so that the compiler's barrier
    analysis tells the stages apart (views of one allocation alias in its eyes, even at constant indices)."""
    sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    w0 = gl.allocate_shared_memory(gl.int32, [BN, BK // 8], sl)
    w1 = gl.allocate_shared_memory(gl.int32, [BN, BK // 8], sl)
    if STAGES == 2:
        stages = (w0, w1)
    else:
        stages = (w0, w1, gl.allocate_shared_memory(gl.int32, [BN, BK // 8], sl),
                  gl.allocate_shared_memory(gl.int32, [BN, BK // 8], sl))
    return stages


@gluon.jit
def _mainloop_cp(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
    """_mainloop with the weight words streamed through STAGES shared-memory stages by cp.async (STAGES - 1
    k steps in flight per program, independent of registers) instead of 16-byte loads one step ahead.
    Unrolled by STAGES (2 or 4) so that every buffer is its own allocation: one thread barrier per step.
    The K range must hold a whole number of rounds (the launcher takes the loads otherwise)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    words_l: gl.constexpr = _words_layout(BN, BK, NW)
    bs = (gl.allocate_shared_memory(gl.bfloat16, [BM, BK], b_sl), gl.allocate_shared_memory(gl.bfloat16, [BM, BK], b_sl))
    ws = _alloc_stages(BN, BK, STAGES)
    ws2 = ws
    if DUAL:
        ws2 = _alloc_stages(BN, BK, STAGES)
    n_steps = (k_end - k_begin) // BK
    for u in gl.static_range(STAGES - 1):
        live = gl.full([BN, BK // 8], u, gl.int32, layout=words_l) < n_steps
        _copy_words(ws[u], w_ptrs, k_begin + u * BK, live)
        if DUAL:
            _copy_words(ws2[u], w2_ptrs, k_begin + u * BK, live)
        async_copy.commit_group()
    acc = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    acc2 = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    sc, sc2, act = _load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, DUAL)
    for i0 in range(0, n_steps, STAGES):
        for u in gl.static_range(STAGES):
            sc, sc2, act, acc, acc2 = _cp_step(u, i0 + u, ws, ws2, bs, w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask,
                                               k_begin, k_end, n_steps, sc, sc2, act, acc, acc2, DUAL, BM, BN, BK, NW,
                                               STAGES)
    wait_own_copies_0()  # the last (dead) copies, before the buffers go
    return acc, acc2


@gluon.jit
def _k_slice(K, k_index, SPLIT: gl.constexpr, BK: gl.constexpr):
    """This program's K range: all of K, or slice k_index of SPLIT (K a multiple of SPLIT * BK)."""
    if SPLIT == 1:
        k_begin = 0
        k_end = K
    else:
        k_len = K // SPLIT
        k_begin = gl.multiple_of(k_index * k_len, BK)
        k_end = k_begin + k_len
    return k_begin, k_end


@gluon.jit
def _l1_rows(z_ptr, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, w_desc, w_row, sorted_ptr, act_ptr, h_part_ptr, n_rows,
             k_index, row0, n0, inter, K, top_k, beta, lin_beta, ROWS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
             NW: gl.constexpr, SPLIT: gl.constexpr, RING: gl.constexpr, STAGES: gl.constexpr):
    """act[row0 .. row0 + ROWS, n0 .. n0 + BN] = bf16(SiTU(gate, up)) of the rows' tokens; with SPLIT > 1
    this K slice's FP32 gate and up sums into h_part[slice, rows, n (gate) | inter + n (up)] instead."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    act_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    pos = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    pair = gl.load(sorted_ptr + pos)
    tok = gl.where(pair >= 0, pair // top_k, 0)
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, act_l))
    a_ptrs = z_ptr + tok[:, None].to(gl.int64) * K + ak[None, :]
    a_mask = (pair >= 0)[:, None] & (ak >= 0)[None, :]
    k_begin, k_end = _k_slice(K, k_index, SPLIT, BK)
    if RING == "tma":
        g, u = _mainloop_tma(w_desc, w_row, sg_ptrs, su_ptrs, a_ptrs, a_mask, k_begin, k_end, True, ROWS, BN, BK, NW)
    elif RING == "cp":
        g, u = _mainloop_cp(wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, a_ptrs, a_mask, k_begin, k_end, True, ROWS, BN, BK,
                            NW, STAGES)
    else:
        g, u = _mainloop(wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, a_ptrs, a_mask, k_begin, k_end, True, ROWS, BN, BK, NW)
    g = g * _UNWINDOW
    u = u * _UNWINDOW
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l))
    if SPLIT == 1:
        # numerics.situ itself (a @triton.jit function inlined by Gluon: the same SASS as a hand copy)
        h = situ(g, u, beta, lin_beta)
        gl.store(act_ptr + om[None, :].to(gl.int64) * inter + on[:, None], h.to(act_ptr.dtype.element_ty))
    else:
        part_row = k_index * n_rows + om
        dest = h_part_ptr + part_row[None, :].to(gl.int64) * (2 * inter) + on[:, None]
        gl.store(dest, g)
        gl.store(dest + inter, u)


@gluon.jit
def _l2_rows(act_ptr, w_ptrs, s_ptrs, w_desc, w_row, sorted_ptr, pairs_ptr, slice_stride, k_index, row0, n0, latent,
             K, ROWS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr,
             RING: gl.constexpr, STAGES: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T for the valid rows of row0 .. row0 + ROWS
    (with SPLIT > 1: this K slice's sum, at pairs + slice * slice_stride)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    act_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    am = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, act_l))
    a_ptrs = act_ptr + am[:, None].to(gl.int64) * K + ak[None, :]
    a_mask = (am >= 0)[:, None] & (ak >= 0)[None, :]
    k_begin, k_end = _k_slice(K, k_index, SPLIT, BK)
    if RING == "tma":
        acc, acc2 = _mainloop_tma(w_desc, w_row, s_ptrs, s_ptrs, a_ptrs, a_mask, k_begin, k_end, False, ROWS, BN, BK,
                                  NW)
    elif RING == "cp":
        acc, acc2 = _mainloop_cp(w_ptrs, s_ptrs, w_ptrs, s_ptrs, a_ptrs, a_mask, k_begin, k_end, False, ROWS, BN, BK,
                                 NW, STAGES)
    else:
        acc, acc2 = _mainloop(w_ptrs, s_ptrs, w_ptrs, s_ptrs, a_ptrs, a_mask, k_begin, k_end, False, ROWS, BN, BK, NW)
    acc = acc * _UNWINDOW
    if SPLIT > 1:
        pairs_ptr += k_index.to(gl.int64) * slice_stride
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l))
    pair = gl.load(sorted_ptr + om)
    dest = pairs_ptr + pair[None, :].to(gl.int64) * latent + on[:, None]
    gl.store(dest, acc, mask=(pair >= 0)[None, :] & (on >= 0)[:, None])


@gluon.jit
def _half_block(sorted_ptr, row0, BM: gl.constexpr, NW: gl.constexpr):
    """True when a 32-row block holds at most 16 valid rows (they come first): then the MMA runs
    with N = 16 on its first half. Decode batches estimate rows per expert from all (token, slot)
    pairs, most of which, under expert parallelism, belong to other ranks."""
    rows_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    valid = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=rows_l)) >= 0
    return gl.sum(valid.to(gl.int32), axis=0) <= BM // 2


@gluon.jit
def _program_tile(block_expert_ptr, n_total, BN: gl.constexpr, SPLIT: gl.constexpr):
    """This program's expert block, its first weight row, the block's expert (-1: unused block) and its
    K slice. The block is the slowest index: the programs of the used blocks (which come first) start
    before the unused blocks' programs, which only read the expert and exit."""
    tiles_n = n_total // BN
    pid = gl.program_id(0)
    blk = pid // (tiles_n * SPLIT)
    within = pid % (tiles_n * SPLIT)
    return blk, (within % tiles_n) * BN, gl.load(block_expert_ptr + blk), within // tiles_n


@gluon.jit(do_not_specialize=["top_k"])
def l1_regs_kernel(
    z_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, h_part_ptr, n_rows, inter, K, row_words, row_scales,
    top_k, stride_we, stride_se, beta, lin_beta, w_desc,
    BM: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr, SIGNAL: gl.constexpr = False,
    RING: gl.constexpr = "loads", STAGES: gl.constexpr = 0,
):
    if SIGNAL:  # the dependent finish / L2 may launch now (they wait for this kernel's end)
        release_dependents()
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert, k_index = _program_tile(block_expert_ptr, inter, BN, SPLIT)
    if expert >= 0:
        wg_ptrs, sg_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, n0, row_words, row_scales, stride_we, stride_se,
                                        BN, BK, NW)
        wu_ptrs, su_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, inter + n0, row_words, row_scales, stride_we,
                                        stride_se, BN, BK, NW)
        w_row = (2 * expert, n0)  # the gate and up tiles' box in the [2E, I, K / 8] words
        args = (z_ptr, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, w_desc, w_row, sorted_ptr, act_ptr, h_part_ptr, n_rows,
                k_index, blk * BM, n0, inter, K, top_k, beta, lin_beta)
        if BM == 32:
            if _half_block(sorted_ptr, blk * BM, BM, NW):
                _l1_rows(*args, 16, BN, BK, NW, SPLIT, RING, STAGES)
            else:
                _l1_rows(*args, 32, BN, BK, NW, SPLIT, RING, STAGES)
        else:
            _l1_rows(*args, BM, BN, BK, NW, SPLIT, RING, STAGES)


@gluon.jit
def l2_regs_kernel(
    act_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, slice_stride, latent, K, row_words, row_scales,
    stride_we, stride_se, w_desc,
    BM: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
    RING: gl.constexpr = "loads", STAGES: gl.constexpr = 0,
):
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    # block_expert was written by the grouping, which finished before L1 started: readable before the wait.
    blk, n0, expert, k_index = _program_tile(block_expert_ptr, latent, BN, SPLIT)
    if PDL:
        # Launched as a programmatic dependent of L1 (or its finish): this program's weight rows go to
        # L2 while L1 runs; act is read only after the wait, and nothing is written before it.
        if expert >= 0:
            rows_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
            rows = n0 + gl.arange(0, BN, layout=rows_l)
            k_begin, k_end = _k_slice(K, k_index, SPLIT, BK)
            first = w_ptr + expert.to(gl.int64) * stride_we + rows.to(gl.int64) * row_words + k_begin // 8
            prefetch_rows_l2(first.to(gl.int64), gl.full([BN], 0, gl.int32, layout=rows_l) + (k_end - k_begin) // 2)
        wait_for_predecessor()
    if expert >= 0:
        w_ptrs, s_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, n0, row_words, row_scales, stride_we, stride_se,
                                      BN, BK, NW)
        w_row = expert * (stride_we // row_words) + n0
        args = (act_ptr, w_ptrs, s_ptrs, w_desc, w_row, sorted_ptr, pairs_ptr, slice_stride, k_index, blk * BM, n0,
                latent, K)
        if BM == 32:  # the same test as L1 on the same block: L1 wrote every row this reads
            if _half_block(sorted_ptr, blk * BM, BM, NW):
                _l2_rows(*args, 16, BN, BK, NW, SPLIT, RING, STAGES)
            else:
                _l2_rows(*args, 32, BN, BK, NW, SPLIT, RING, STAGES)
        else:
            _l2_rows(*args, BM, BN, BK, NW, SPLIT, RING, STAGES)
