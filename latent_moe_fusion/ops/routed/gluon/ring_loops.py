"""The weight rings of the register-dequant kernels (routed_gemm.py): the weight words of each k step
stream through shared-memory stages (k steps in flight independent of registers) instead of 16-byte
loads one step ahead, and each thread reads back its own fragment's 16 bytes.

- `mainloop_tma`: 4 stages filled by TMA from one thread (L1's gate and up tiles in one 3-d box), one
  mbarrier each; a stage is refilled one step after its last read, armed one step before.
- `mainloop_cp`: 2 or 4 stages filled per thread by cp.async (zero-filled past the K range), drained by
  a plain `cp.async.wait_group` (each thread reads back only what it copied).

The only CTA barriers are the activation tile's: the cp.async ring double-buffers it (one barrier per
step, as the loads loop), the TMA ring keeps one buffer (two per step, and fewer instructions:
_tma_step). Triton's barrier analysis treats views of one shared-memory allocation as aliases, even at
constant indices, and would add a barrier per conflicting pair; so every stage and barrier is its own
allocation and the loop is unrolled by the ring (the K range must hold whole rounds: gluon.
ring_for). Same MMAs on the same dequantised values as the loads loop: the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from ...common.gdc import wait_own_copies_0, wait_own_copies_2
from ...common.triton_compat import cta_barrier
from .lut_dequant import dequant_mma, to_kappa, words_layout


@gluon.jit
def load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k, DUAL: gl.constexpr):
    """One k step's scale bytes (and the second tile's if DUAL) and activation tile: what each loop loads
    beside its weight words."""
    sc = gl.load(s_ptrs + k // 32)
    sc2 = sc
    if DUAL:
        sc2 = gl.load(s2_ptrs + k // 32)
    return sc, sc2, gl.load(a_ptrs + k, mask=a_mask, other=0.0)


@gluon.jit
def _next_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, i, DUAL: gl.constexpr, BK: gl.constexpr):
    """Step i + 1's scales and activation tile (the last step reloads its own). ptxas gives every global load
    of the loop one scoreboard, so a step that issues these before it reads step i's activation registers
    waits for them too (ncu: a fifth of L1's stall samples at M = 8 on that wait). The TMA ring's step
    issues them after its barrier ("late") for 32-row MMAs, before its stage wait ("early") for 16-row ones
    (ORDER "auto"; the mxfp4_load_order tuning override forces either): with the late issue ptxas also fits L1's
    32-row kernel in 155 registers instead of 177 (3 CTAs per SM instead of 2; 167 against 185 with the
    double activation buffer, when L1 at M = 128 took 405 against 453 us); 16-row MMAs were faster early
    (73.8 against 75.0 us at M = 8; H200, double buffer; docs/design/routed-decode.md). The cp.async
    ring issues them first (after its barrier it was slower at every M)."""
    k_nx = gl.multiple_of(gl.minimum(k_begin + (i + 1) * BK, k_end - BK), BK)
    return load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_nx, DUAL)


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
def _tma_step(u: gl.constexpr, i, ws, rs, buf, w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, n_steps,
              sc, sc2, act, acc, acc2, DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
              NW: gl.constexpr, ORDER: gl.constexpr):
    STAGES: gl.constexpr = 4
    words_l: gl.constexpr = words_layout(BN, BK, NW)
    # When the next step's scales and activation tile are issued: see _next_scales_act.
    LATE: gl.constexpr = ORDER == "late" or (ORDER == "auto" and BM > 16)
    if not LATE:
        sc_nx, sc2_nx, act_nx = _next_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, i, DUAL, BK)
    mbarrier.wait(rs[u], (i // STAGES) & 1)
    wd = _tile_words(ws[u], 0, DUAL, words_l)
    wd2 = wd
    if DUAL:
        wd2 = _tile_words(ws[u], 1, DUAL, words_l)
    # One activation buffer for every step: the compiler puts a CTA barrier before this store (the last
    # step's wgmma read the buffer), and the loop then keeps its few wgmma descriptors in uniform
    # registers. With two buffers alternating it rebuilt sixteen per step (~30 uniform moves) and L2
    # spilled: 415 -> 385 instructions per step in L1 (tests/test_gluon_compile_sm90.py); on the H200 L1 3-5 % faster at
    # M = 8 .. 128, L2 5 % at M = 8 / 32 and 20 % at M = 128 (docs/design/routed-decode.md).
    buf.store(to_kappa(act, BM, BK))
    # Orders this thread's activation stores and its reads of the stage before the async-proxy accesses
    # after the barrier (the wgmma's read of the activation tile, the stage's refill).
    fence_async_shared()
    # The activation tile is complete, every warp has read stage u - 1 (which now takes step i + 3; armed
    # one step ago) and waited on stage u (armed now for step i + 4, filled next step). Every other pair of
    # conflicting accesses is on separate allocations.
    cta_barrier()
    if LATE:
        sc_nx, sc2_nx, act_nx = _next_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, i, DUAL, BK)
    prev: gl.constexpr = (u + STAGES - 1) % STAGES
    refill = i + STAGES - 1
    tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, k_begin + refill * BK, DUAL), rs[prev], ws[prev],
                                    pred=(i >= 1) & (refill < n_steps))
    mbarrier.expect(rs[u], w_desc.block_type.nbytes, pred=i + STAGES < n_steps)
    acc = dequant_mma(wd, sc, buf, acc, BM, BN, BK, NW)
    if DUAL:
        acc2 = dequant_mma(wd2, sc2, buf, acc2, BM, BN, BK, NW)
    return sc_nx, sc2_nx, act_nx, acc, acc2


@gluon.jit
def mainloop_tma(w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, ORDER: gl.constexpr):
    """_mainloop with the weight words streamed by TMA through a ring of 4 shared-memory stages (3 k
    steps ahead per program, independent of registers) instead of 16-byte loads one step ahead. Unrolled
    by 4, every stage and barrier its own allocation: two CTA barriers per step, both for the activation
    tile (complete before the wgmma; read by the last step's wgmma before the store). The K range must hold a
    whole number of rounds (the launcher takes the loads otherwise: a guarded last round cost registers
    and time in the whole kernel: docs/design/routed-decode.md)."""
    STAGES: gl.constexpr = 4
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    buf = gl.allocate_shared_memory(gl.bfloat16, [BM, BK], b_sl)  # one activation buffer: see _tma_step
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
    sc, sc2, act = load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, DUAL)
    for i0 in range(0, n_steps, STAGES):
        for u in gl.static_range(STAGES):
            sc, sc2, act, acc, acc2 = _tma_step(u, i0 + u, ws, rs, buf, w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask,
                                                k_begin, k_end, n_steps, sc, sc2, act, acc, acc2, DUAL, BM, BN, BK, NW,
                                                ORDER)
    return acc, acc2


@gluon.jit
def _copy_words(dest, w_ptrs, k, live):
    """This thread's 16-byte weight chunks of one k step into a ring stage (cp.async; zeros where not live)."""
    async_copy.async_copy_global_to_shared(dest, w_ptrs + k // 8, mask=live)


@gluon.jit
def _cp_step(u: gl.constexpr, i, ws, ws2, bs, w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, n_steps,
             sc, sc2, act, acc, acc2, DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             BK: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
    words_l: gl.constexpr = words_layout(BN, BK, NW)
    sc_nx, sc2_nx, act_nx = _next_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, i, DUAL, BK)
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
    cta_barrier()
    nxt = i + STAGES - 1
    live = gl.full([BN, BK // 8], nxt, gl.int32, layout=words_l) < n_steps
    k_fill = k_begin + gl.minimum(nxt, n_steps - 1) * BK
    _copy_words(ws[(u + STAGES - 1) % STAGES], w_ptrs, k_fill, live)
    if DUAL:
        _copy_words(ws2[(u + STAGES - 1) % STAGES], w2_ptrs, k_fill, live)
    async_copy.commit_group()
    acc = dequant_mma(ws[u].load(words_l), sc, buf, acc, BM, BN, BK, NW)
    if DUAL:
        acc2 = dequant_mma(ws2[u].load(words_l), sc2, buf, acc2, BM, BN, BK, NW)
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
def mainloop_cp(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, STAGES: gl.constexpr):
    """_mainloop with the weight words streamed through STAGES shared-memory stages by cp.async (STAGES - 1
    k steps in flight per program, independent of registers) instead of 16-byte loads one step ahead.
    Unrolled by STAGES (2 or 4) so that every buffer is its own allocation: one thread barrier per step.
    The K range must hold a whole number of rounds (the launcher takes the loads otherwise)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    words_l: gl.constexpr = words_layout(BN, BK, NW)
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
    sc, sc2, act = load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, DUAL)
    for i0 in range(0, n_steps, STAGES):
        for u in gl.static_range(STAGES):
            sc, sc2, act, acc, acc2 = _cp_step(u, i0 + u, ws, ws2, bs, w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask,
                                               k_begin, k_end, n_steps, sc, sc2, act, acc, acc2, DUAL, BM, BN, BK, NW,
                                               STAGES)
    wait_own_copies_0()  # the last (dead) copies, before the buffers go
    return acc, acc2
