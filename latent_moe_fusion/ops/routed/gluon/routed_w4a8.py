"""Routed MXFP4 expert GEMMs on FP8 activations (W4A8, opt-in: LMF_ROUTED_W4A8; 128-row prefill blocks, sm_90).

What they compute is ops/routed/w4a8_numerics.py's definition, which a float64 reference reproduces: the activations
in 1 x 128 e4m3 blocks with FP32 scales (ops/routed/triton/quantize_1x128.py), the e2m1 weights expanded to e4m3
against the largest E8M0 exponent of each 64-row x 128-k weight block, and each 128-wide k step's FP8 MMA sums
promoted into FP32 accumulators with the step's two scales (the tensor cores' FP8 sums keep fewer bits than FP32, so
nothing accumulates across steps inside them).

Tokens are the MMA's M side (two warp groups of 64 rows), weight rows its N side: a thread's accumulator rows are
two tokens, so the promotion takes one activation scale per row and one weight scale per 64 columns: one FFMA per
accumulator element. Per 128-wide k step of a program (128 tokens x 128 weight rows):

- the weight words (128 rows x 64 bytes) arrive by TMA through a 4-stage ring;
- the activation rows (128 x 128 e4m3) go to shared memory by cp.async, two steps ahead (4 buffers);
- every thread expands 8 words (two rows x 32 k under one E8M0 byte each) to e4m3 by table: d (the block's largest
  exponent minus the word's) picks the 8 bytes e4m3(magnitude * 2^-d) (shift_tables; exact while d <= 8, rounded
  to nearest beyond, as the definition says), prmt looks the codes up and adds the signs; 4 tiles of [128, 128]
  e4m3, 16-byte stores;
- one CTA barrier; the previous step's MMAs are waited for and promoted, then this step's two wgmma (gate and up
  columns, or L2's two 64-column halves) go out asynchronously: the tensor cores run step i while the threads
  expand step i + 1.

Buffer reuse: a weight tile is rewritten 4 steps later, an activation buffer refilled for step i + 4 at step i + 2,
a TMA stage refilled at step i + 1 after the barrier: every warp group has waited for wgmma i before the barrier of
step i + 2 (both warp groups read the whole weight tile, so unlike routed_staged.py no tile is private to a group).

One CTA of 8 warps per SM (the accumulators and the step's MMA sums take 128 registers a thread; shared memory
160 KB). L1 writes bf16 SiTU activation rows, which the act quantiser turns into L2's e4m3 rows.
"""

from __future__ import annotations

import torch
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
from ...common.mxfp4 import e2m1_lut
from ...common.triton_compat import cta_barrier
from ...common.triton_numerics import situ
from .ring_loops import _alloc_ring, _ring_coord
from .routed_gemm import _program_tile

RING: gl.constexpr = gl.constexpr(4)  # stages of every ring and weight tiles; the k loop is unrolled by it
STEP: gl.constexpr = gl.constexpr(128)  # k per step: one promotion block

# $2: a word of 8 codes (code i in bits 4i .. 4i + 3); $3, $4: the e4m3 bytes of the 8 magnitudes times 2^-d
# (shift_tables: magnitudes 0 .. 3, 4 .. 7); $0: codes 0 .. 3 as e4m3 bytes in k order, $1: codes 4 .. 7. One prmt
# looks 4 magnitudes up in the table (its selector nibbles: the codes with their sign bits cleared), one prmt in
# sign-replicate mode spreads the 4 signs to their bytes (W << 4 holds the even codes' signs at its byte tops, W the
# odd ones'), one lop3 ORs them in: 10 instructions a word, no conversion. The CPU emulator test runs this text.
FP4_TO_E4M3_LUT_ASM = """
        {
        .reg .b32 y, m, s;
        shl.b32 y, $2, 4;
        and.b32 m, $2, 0x7777;
        prmt.b32 m, $3, $4, m;
        prmt.b32 s, y, $2, 0xD9C8;
        lop3.b32 $0, m, s, 0x80808080, 0xF8;
        shr.b32 m, $2, 16;
        and.b32 m, m, 0x7777;
        prmt.b32 m, $3, $4, m;
        prmt.b32 s, y, $2, 0xFBEA;
        lop3.b32 $1, m, s, 0x80808080, 0xF8;
        }
        """
_LUT_TEXT = gl.constexpr(FP4_TO_E4M3_LUT_ASM)
SHIFTS = 32  # d = 0 .. 31 tabled; from d = 29 on every product lies below half of e4m3's smallest subnormal
_MAX_SHIFT = gl.constexpr(SHIFTS - 1)
_NAN_BITS = gl.constexpr(0x7FC00000)
E8M0_NAN_BYTE = gl.constexpr(255)


@gluon.constexpr_function
def _words_layout(NW):
    """int32 words [BN, 4, 4] (row, 32-k chunk, word) of one step: a thread holds one chunk (4 words, one E8M0
    byte) of row r (and r + 64 where BN = 128): 16-byte loads, 4 threads a row."""
    return gl.BlockedLayout([1, 1, 4], [8, 4, 1], [NW, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _act_layout(NW):
    """[rows, 128] e4m3 activation chunks: 16 consecutive k (one cp.async) per thread."""
    return gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])


@gluon.constexpr_function
def _mma_layout(NW, HALF):
    """The accumulators [128 tokens, HALF weight rows]: HALF = BN / 2 columns a wgmma."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HALF, 32])


@gluon.jit
def expand_e4m3(words, table_lo, table_hi):
    """int32 words (8 codes each) and their shift tables -> two int32 tensors: codes 0 .. 3 and 4 .. 7 of each word
    as e4m3 bytes in k order."""
    return gl.inline_asm_elementwise(
        asm=_LUT_TEXT, constraints="=r,=r,r,r,r", args=[words, table_lo, table_hi], dtype=(gl.int32, gl.int32),
        is_pure=True, pack=1,
    )


@gluon.jit
def _block_scale(group_exp):
    """A block's largest E8M0 exponent (int32) -> its FP32 scale 2^(g - 127) (NaN for the NaN byte; 0 for byte 0,
    as the bf16 kernels read it)."""
    bits = gl.where(group_exp == E8M0_NAN_BYTE, _NAN_BITS, group_exp << 23)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _copy_act(buf, a_rows, a_mask, k, live, NW: gl.constexpr):
    """The activation chunk of one k step into buf by cp.async (zeros for rows without a pair or a dead step)."""
    ak = gl.arange(0, STEP, layout=gl.SliceLayout(0, _act_layout(NW)))
    async_copy.async_copy_global_to_shared(buf, a_rows + (k + ak)[None, :], mask=a_mask & live)
    async_copy.commit_group()


@gluon.jit
def _w4a8_step(u: gl.constexpr, i, n_steps, ws, rs, wts, acts, w_desc, w_row, s_ptrs, g_ptrs, tab_ptr, gs0_ptr,
               gs1_ptr, as_ptrs, as_mask, a_rows, a_mask, acc0, acc1, t0, t1, scale0, scale1, GATED: gl.constexpr,
               BN: gl.constexpr, NW: gl.constexpr):
    k = i * STEP
    mbarrier.wait(rs[u], (i // RING) & 1)
    stage = ws[u]
    if GATED:
        stage = stage._reinterpret(gl.int32, [BN, 16],
                                   gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    words_l: gl.constexpr = _words_layout(NW)
    words = gl.convert_layout(gl.reshape(stage.load(gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [1, 0])), [BN, 4, 4]),
                              words_l, assert_trivial=True)
    sc = gl.load(s_ptrs + i * 4).to(gl.int32)
    gx = gl.load(g_ptrs + i).to(gl.int32)
    shift = gl.minimum(gx - sc, _MAX_SHIFT)  # >= 0: gx is the block's largest exponent
    lo, hi = expand_e4m3(words, gl.load(tab_ptr + 2 * shift), gl.load(tab_ptr + 2 * shift + 1))
    tile_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    wts[u]._reinterpret(gl.int32, [BN, 32], tile_l).store(gl.reshape(gl.join(lo, hi), [BN, 32]))
    wait_own_copies_1()  # this thread's activation copies of step i (step i + 1's may still fly)
    fence_async_shared()  # the tile's stores (generic proxy) before the wgmma's reads (async proxy)
    # Every thread's tile stores and activation copies of step i are in; every warp group has waited for the
    # wgmma of step i - 1 (the last reader of the buffers refilled below) and read stage u - 1.
    cta_barrier()
    _copy_act(acts[(u + 2) % RING], a_rows, a_mask, k + 2 * STEP, i + 2 < n_steps, NW)
    refill = i + RING - 1
    prev: gl.constexpr = (u + RING - 1) % RING
    tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, refill * STEP, GATED), rs[prev], ws[prev],
                                    pred=(i >= 1) & (refill < n_steps))
    mbarrier.expect(rs[u], w_desc.block_type.nbytes, pred=i + RING < n_steps)
    # Promote the previous step's sums (zero sums and zero scales before the first step).
    t0, t1 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t1))
    acc0 = acc0 + t0 * scale0[:, None]
    acc1 = acc1 + t1 * scale1[:, None]
    a_scale = gl.load(as_ptrs + i, mask=as_mask, other=0.0)
    scale0 = a_scale * _block_scale(gl.load(gs0_ptr + i).to(gl.int32))
    scale1 = a_scale * _block_scale(gl.load(gs1_ptr + i).to(gl.int32))
    tile = wts[u]
    t0 = warpgroup_mma(acts[u], tile.slice(0, BN // 2).permute((1, 0)), t0, use_acc=False, is_async=True)
    t1 = warpgroup_mma(acts[u], tile.slice(BN // 2, BN // 2).permute((1, 0)), t1, use_acc=False, is_async=True)
    # Tensors of the sums in flight (no wait). The accumulators ride along as dependencies: otherwise the compiler
    # sinks the promotions to the end of the unrolled steps and keeps every step's sums live (255 registers, spills,
    # serialised wgmma).
    t0, t1, acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(t0, t1, acc0, acc1))
    return acc0, acc1, t0, t1, scale0, scale1


@gluon.jit
def _w4a8_mainloop(w_desc, w_row, s_ptrs, g_ptrs, tab_ptr, gs0_ptr, gs1_ptr, as_ptrs, as_mask, a_rows, a_mask, K,
                   GATED: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr):
    """(acc0, acc1) [128 rows, BN / 2]: the rows' activations times the tile's two halves of weight rows over K,
    promoted per 128-wide step. s_ptrs: the thread's E8M0 bytes at k = 0 ([BN, 4, 1]); g_ptrs: its rows' block
    exponents at k = 0 ([BN, 1, 1]); tab_ptr: shift_tables' int32 pairs; gs0_ptr, gs1_ptr: the halves' blocks'
    exponents at k = 0; as_ptrs, as_mask:
    the rows' activation scales at k = 0 (the MMA's row layout); a_rows, a_mask: the rows' e4m3 activations."""
    HALF: gl.constexpr = BN // 2
    mma_l: gl.constexpr = _mma_layout(NW, HALF)
    ws, rs = _alloc_ring(w_desc, RING)  # separate allocations: the compiler's barrier analysis tells them apart
    op_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    wts = (gl.allocate_shared_memory(gl.float8e4nv, [BN, STEP], op_l),
           gl.allocate_shared_memory(gl.float8e4nv, [BN, STEP], op_l),
           gl.allocate_shared_memory(gl.float8e4nv, [BN, STEP], op_l),
           gl.allocate_shared_memory(gl.float8e4nv, [BN, STEP], op_l))
    acts = (gl.allocate_shared_memory(gl.float8e4nv, [128, STEP], op_l),
            gl.allocate_shared_memory(gl.float8e4nv, [128, STEP], op_l),
            gl.allocate_shared_memory(gl.float8e4nv, [128, STEP], op_l),
            gl.allocate_shared_memory(gl.float8e4nv, [128, STEP], op_l))
    n_steps = K // STEP
    for st in gl.static_range(RING):
        mbarrier.init(rs[st], count=1)
    for st in gl.static_range(RING):
        mbarrier.expect(rs[st], w_desc.block_type.nbytes, pred=st < n_steps)
        tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, st * STEP, GATED), rs[st], ws[st],
                                        pred=st < n_steps)
    _copy_act(acts[0], a_rows, a_mask, 0, n_steps > 0, NW)
    _copy_act(acts[1], a_rows, a_mask, STEP, n_steps > 1, NW)
    acc0 = gl.zeros([128, HALF], gl.float32, layout=mma_l)
    acc1 = gl.zeros([128, HALF], gl.float32, layout=mma_l)
    t0 = gl.zeros([128, HALF], gl.float32, layout=mma_l)
    t1 = gl.zeros([128, HALF], gl.float32, layout=mma_l)
    scale0 = gl.zeros([128], gl.float32, layout=gl.SliceLayout(1, mma_l))
    scale1 = gl.zeros([128], gl.float32, layout=gl.SliceLayout(1, mma_l))
    for i0 in range(0, n_steps, RING):
        for u in gl.static_range(RING):
            acc0, acc1, t0, t1, scale0, scale1 = _w4a8_step(
                u, i0 + u, n_steps, ws, rs, wts, acts, w_desc, w_row, s_ptrs, g_ptrs, tab_ptr, gs0_ptr, gs1_ptr,
                as_ptrs, as_mask, a_rows, a_mask, acc0, acc1, t0, t1, scale0, scale1, GATED, BN, NW)
    t0, t1 = warpgroup_mma_wait(num_outstanding=0, deps=(t0, t1))
    wait_own_copies_0()  # the dead steps' copies, before the buffers go
    return acc0 + t0 * scale0[:, None], acc1 + t1 * scale1[:, None]


@gluon.jit
def _weight_ptrs(s_ptr, g_ptr, expert, row_a, row_b, row_scales, stride_se, stride_ge, blocks, BN: gl.constexpr,
                 NW: gl.constexpr):
    """Pointers at k = 0 for a tile of weight rows row_a .. row_a + BN / 2 then row_b .. row_b + BN / 2 (each half
    inside one 64-row exponent block): the thread's E8M0 bytes [BN, 4, 1], its rows' block exponents [BN, 1, 1], and
    the two halves' blocks' (scalars)."""
    words_l: gl.constexpr = _words_layout(NW)
    HALF: gl.constexpr = BN // 2
    r = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, words_l)))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, words_l)))
    rows = gl.where(r < HALF, row_a + r, row_b + r - HALF)
    s_base = s_ptr + expert.to(gl.int64) * stride_se
    s_ptrs = (s_base + rows[:, None].to(gl.int64) * row_scales + c[None, :])[:, :, None]
    g_base = g_ptr + expert.to(gl.int64) * stride_ge
    g_ptrs = (g_base + (rows // 64) * blocks)[:, None, None]
    return s_ptrs, g_ptrs, g_base + (row_a // 64) * blocks, g_base + (row_b // 64) * blocks


@gluon.jit(do_not_specialize=["top_k"])
def l1_w4a8_kernel(z8_ptr, zs_ptr, s_ptr, g_ptr, tab_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K, row_scales,
                   top_k, stride_se, stride_ge, beta, lin_beta, w_desc, BM: gl.constexpr, BN: gl.constexpr,
                   num_warps: gl.constexpr):
    """act[block rows, n0 .. n0 + BN / 2] = bf16(SiTU(gate, up)) from the e4m3 z rows (z8, zs: quantize_1x128(z));
    one program per (128-row block, BN / 2 columns); the gate rows and the same columns' up rows in one 3-d TMA box."""
    NW: gl.constexpr = num_warps
    HALF: gl.constexpr = BN // 2
    blk, n0, expert, _ = _program_tile(block_expert_ptr, inter, HALF, 1)
    if expert >= 0:
        row0 = blk * BM
        act_l: gl.constexpr = _act_layout(NW)
        pair = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, act_l)))
        tok = gl.where(pair >= 0, pair // top_k, 0)
        a_rows = (z8_ptr + tok.to(gl.int64) * K)[:, None]
        mma_l: gl.constexpr = _mma_layout(NW, HALF)
        pair_m = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_l)))
        tok_m = gl.where(pair_m >= 0, pair_m // top_k, 0)
        blocks = K // STEP
        s_ptrs, g_ptrs, gs0, gs1 = _weight_ptrs(s_ptr, g_ptr, expert, n0, inter + n0, row_scales, stride_se,
                                                stride_ge, blocks, BN, NW)
        acc_g, acc_u = _w4a8_mainloop(w_desc, (2 * expert, n0), s_ptrs, g_ptrs, tab_ptr, gs0, gs1,
                                      zs_ptr + tok_m.to(gl.int64) * blocks, pair_m >= 0, a_rows, (pair >= 0)[:, None],
                                      K, True, BN, NW)
        h = situ(acc_g, acc_u, beta, lin_beta)
        on = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_l))
        om = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_l))
        gl.store(act_ptr + om[:, None].to(gl.int64) * inter + on[None, :], h.to(act_ptr.dtype.element_ty))


@gluon.jit
def l2_w4a8_kernel(a8_ptr, as_ptr, s_ptr, g_ptr, tab_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, latent, K, row_scales,
                   stride_se, stride_ge, w_desc, BM: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T (FP32) from the e4m3 act rows (a8, as:
    quantize_1x128(act, live=sorted pairs)) for the valid rows of each block; one program per (block, BN
    columns)."""
    NW: gl.constexpr = num_warps
    HALF: gl.constexpr = BN // 2
    blk, n0, expert, _ = _program_tile(block_expert_ptr, latent, BN, 1)
    if expert >= 0:
        row0 = blk * BM
        act_l: gl.constexpr = _act_layout(NW)
        am = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, act_l))
        a_rows = (a8_ptr + am.to(gl.int64) * K)[:, None]
        a_mask = (gl.load(sorted_ptr + am) >= 0)[:, None]
        mma_l: gl.constexpr = _mma_layout(NW, HALF)
        om = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, mma_l))
        pair = gl.load(sorted_ptr + om)
        blocks = K // STEP
        s_ptrs, g_ptrs, gs0, gs1 = _weight_ptrs(s_ptr, g_ptr, expert, n0, n0 + HALF, row_scales, stride_se,
                                                stride_ge, blocks, BN, NW)
        acc0, acc1 = _w4a8_mainloop(w_desc, expert * latent + n0, s_ptrs, g_ptrs, tab_ptr, gs0, gs1,
                                    as_ptr + om.to(gl.int64) * blocks, pair >= 0, a_rows, a_mask, K, False, BN, NW)
        on = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_l))
        dest = pairs_ptr + pair[:, None].to(gl.int64) * latent + on[None, :]
        live = (pair >= 0)[:, None] & (on >= 0)[None, :]
        gl.store(dest, acc0, mask=live)
        gl.store(dest + HALF, acc1, mask=live)


def shift_tables(device: torch.device) -> torch.Tensor:
    """int32 [SHIFTS, 2]: row d holds the e4m3 bytes of e2m1 magnitudes 0 .. 7 times 2^-d (round to nearest even),
    magnitudes 0 .. 3 in the first word, 4 .. 7 in the second, little-endian (the prmt table of expand_e4m3)."""
    mags = e2m1_lut(torch.device("cpu"))[:8].double()
    d = torch.arange(SHIFTS, dtype=torch.float64)
    table = (mags[None, :] * torch.exp2(-d)[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return table.contiguous().view(torch.int32).reshape(SHIFTS, 2).to(device)
