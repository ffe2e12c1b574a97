"""The FP8 routed kernels' K loop (routed_fp8.py says why and how): MXFP4 weight words through a 4-stage TMA ring,
each 32-wide scale block's codes placed as e4m3 in the wgmma's A registers, the activations' two e4m3 parts from
shared memory, and the block's FP32 sums scaled into the accumulators. DUAL: L1's gate and up tiles (one 3-d box
per stage, two accumulators); else L2's one tile."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...common.triton_compat import cta_barrier
from .ring_loops import _alloc_ring, _ring_coord

STAGES = gl.constexpr(4)
MMA_SCHEDULES = ("pipe", "block")  # _step_mmas; "pipe" the default (H200: docs/design/routed-dequantisation.md)

# $2: 4 bytes of codes packed (pack=4: one register holds word q's 4 bytes); $0: their low nibbles as e4m3, $1 the
# high ones (bit placement, see the module doc). Low: magnitude << 2, sign << 4;
# high: magnitude >> 2, sign in place. The CPU emulator test runs this very text.
FP4_TO_E4M3_ASM = """
        {
        .reg .b32 lo, hi, sg;
        and.b32 lo, $2, 0x07070707;
        shl.b32 lo, lo, 2;
        shl.b32 sg, $2, 4;
        lop3.b32 $0, lo, sg, 0x80808080, 0xF8;
        and.b32 hi, $2, 0x70707070;
        shr.b32 hi, hi, 2;
        lop3.b32 $1, hi, $2, 0x80808080, 0xF8;
        }
        """
_E4M3_TEXT = gl.constexpr(FP4_TO_E4M3_ASM)
_F32_EXP_SHIFT = gl.constexpr(23)
_F32_EXP_MASK = gl.constexpr(0x7F800000)


@gluon.jit
def codes_to_e4m3(codes):
    """uint8 bytes (two e2m1 codes each) -> (low codes, high codes) as e4m3, each the code times 2^-6."""
    lo, hi = gl.inline_asm_elementwise(
        asm=_E4M3_TEXT, constraints="=r,=r,r", args=[codes], dtype=(gl.int8, gl.int8), is_pure=True, pack=4,
    )
    return lo.to(gl.float8e4nv, bitcast=True), hi.to(gl.float8e4nv, bitcast=True)


@gluon.constexpr_function
def bytes_layout(BN, NW):
    """uint8 [BN, 64] of one 128-wide k step (4 scale blocks of 16 bytes): thread q of a row holds bytes
    4q .. 4q + 3 of each block (word q), its rows lane / 4 + {0, 8} of its warp's 16."""
    warp_bases = [[16, 0], [32, 0]] if NW == 4 else [[16, 0], [32, 0], [64, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 16], [0, 32], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_bases, block_bases=[], shape=[BN, 64])


@gluon.jit
def _block_codes(codes, BN: gl.constexpr):
    """uint8 [BN, 64] (a step's 4 blocks, 16 bytes each) -> the 4 blocks' [BN, 16] (register moves only)."""
    x = gl.reshape(codes, [BN, 2, 2, 16])  # (n, j1, j0, byte)
    x = gl.permute(x, [0, 3, 1, 2])  # (n, byte, j1, j0)
    x0, x1 = gl.split(x)  # j0
    c0, c2 = gl.split(x0)  # j1
    c1, c3 = gl.split(x1)
    return c0, c1, c2, c3


@gluon.jit
def _block_operand(codes, BN: gl.constexpr):
    """uint8 [BN, 16] (one block's bytes) -> its e4m3 A operand [BN, 32], kappa = 16 * nibble + byte."""
    lo, hi = codes_to_e4m3(codes)
    x = gl.join(lo, hi)  # (n, byte, nibble)
    x = gl.permute(x, [0, 2, 1])
    return gl.reshape(x, [BN, 32])


@gluon.jit
def _scale_factor(scales, j: gl.constexpr):
    """2^(s - 127) in FP32 for the j-th byte of each int32 (4 blocks' E8M0 bytes): byte 0 gives 0, 255 NaN. The
    byte goes straight to the exponent field: one shift and one mask."""
    if j == 3:
        bits = (scales >> 1) & _F32_EXP_MASK
    else:
        bits = (scales << (_F32_EXP_SHIFT - 8 * j)) & _F32_EXP_MASK
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def _issue(cg, cu, hi_buf, lo_buf, tg, tu, j: gl.constexpr, a_l: gl.constexpr, DUAL: gl.constexpr):
    """Block j's asynchronous MMAs (its codes expanded here, so that only the blocks in flight hold A registers):
    each tile on both activation parts, into fresh FP32 sums."""
    BN: gl.constexpr = cg.shape[0]
    hi_b = hi_buf.slice(32 * j, 32, dim=1).permute((1, 0))
    lo_b = lo_buf.slice(32 * j, 32, dim=1).permute((1, 0))
    ag = gl.convert_layout(_block_operand(cg, BN), a_l, assert_trivial=True)
    tg = warpgroup_mma(ag, hi_b, tg, use_acc=False, is_async=True)
    tg = warpgroup_mma(ag, lo_b, tg, is_async=True)
    if DUAL:
        au = gl.convert_layout(_block_operand(cu, BN), a_l, assert_trivial=True)
        tu = warpgroup_mma(au, hi_b, tu, use_acc=False, is_async=True)
        tu = warpgroup_mma(au, lo_b, tu, is_async=True)
    return tg, tu


@gluon.jit
def _scaled_add(g, u, tg, tu, sc_g, sc_u, j: gl.constexpr, DUAL: gl.constexpr):
    """acc += 2^(s - 127) * block j's sums, per weight row."""
    g = g + _scale_factor(sc_g, j)[:, None] * tg
    if DUAL:
        u = u + _scale_factor(sc_u, j)[:, None] * tu
    return g, u


@gluon.jit
def _step_mmas(cgs, cus, hi_buf, lo_buf, sc_g, sc_u, g, u, pending, a_l: gl.constexpr, MMA: gl.constexpr,
               DUAL: gl.constexpr):
    """The step's 4 blocks: MMAs into fresh sums, then acc += scale * sums, scheduled as MMA says:
    - "pipe": block j + 1's MMAs go out before block j's wait (two blocks in flight), all done by the step's end;
    - "block": block j's MMAs, then block j - 1's scaled adds (pending: the last step's block 3), then the wait.
    (All 16 MMAs then one wait, 255 registers with spills, was 0.89-0.95x "block": docs/design/routed-dequantisation.md.)
    The waits take the accumulators as dependencies: otherwise the compiler sinks every scaled add to the end of the
    step and keeps every block's sums live."""
    tg, tu, sc_p, su_p = pending
    if MMA == "pipe":
        tg0, tu0 = _issue(cgs[0], cus[0], hi_buf, lo_buf, tg, tu, 0, a_l, DUAL)
        for j in gl.static_range(1, 4):
            tg1, tu1 = _issue(cgs[j], cus[j], hi_buf, lo_buf, tg, tu, j, a_l, DUAL)
            tg0, tu0, g, u = warpgroup_mma_wait(2 * (2 if DUAL else 1), deps=[tg0, tu0, g, u])
            g, u = _scaled_add(g, u, tg0, tu0, sc_g, sc_u, j - 1, DUAL)
            tg0, tu0 = tg1, tu1
        tg0, tu0, g, u = warpgroup_mma_wait(0, deps=[tg0, tu0, g, u])
        g, u = _scaled_add(g, u, tg0, tu0, sc_g, sc_u, 3, DUAL)
    else:
        for j in gl.static_range(4):
            tg0, tu0 = tg, tu
            tg, tu = _issue(cgs[j], cus[j], hi_buf, lo_buf, tg0, tu0, j, a_l, DUAL)
            if j == 0:
                g, u = _scaled_add(g, u, tg0, tu0, sc_p, su_p, 3, DUAL)
            else:
                g, u = _scaled_add(g, u, tg0, tu0, sc_g, sc_u, j - 1, DUAL)
            tg, tu, g, u = warpgroup_mma_wait(0, deps=[tg, tu, g, u])
        sc_p, su_p = sc_g, sc_u
    return g, u, (tg, tu, sc_p, su_p)


@gluon.jit
def _stage_codes(stage, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, DUAL: gl.constexpr):
    """A stage's code bytes [BN, BK / 2] per tile in this thread's blocks (bytes_layout)."""
    codes_l: gl.constexpr = bytes_layout(BN, NW)
    flat_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    if DUAL:
        flat = stage._reinterpret(gl.uint8, [2 * BN, BK // 2], flat_l)
        cg = flat.slice(0, BN).load(codes_l)
        cu = flat.slice(BN, BN).load(codes_l)
    else:
        cg = stage._reinterpret(gl.uint8, [BN, BK // 2], flat_l).load(codes_l)
        cu = cg
    return cg, cu


@gluon.jit
def _fp8_step(v: gl.constexpr, i, ws, rs, hi_buf, lo_buf, w_desc, w_row, sg_ptrs, su_ptrs, a_hi_ptrs, a_lo_ptrs,
              a_mask, K, n_steps, sc_g, sc_u, act_hi, act_lo, g, u, pending, ROWS: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr, DUAL: gl.constexpr):
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 32])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=4)
    words_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    # The next step's scales and activation parts (the last step reloads its own).
    k_nx = gl.multiple_of(gl.minimum((i + 1) * BK, K - BK), BK)
    sc_g_nx = gl.load(sg_ptrs + k_nx // 128)
    sc_u_nx = sc_g_nx
    if DUAL:
        sc_u_nx = gl.load(su_ptrs + k_nx // 128)
    act_hi_nx = gl.load(a_hi_ptrs + k_nx // 4, mask=a_mask, other=0)
    act_lo_nx = gl.load(a_lo_ptrs + k_nx // 4, mask=a_mask, other=0)
    mbarrier.wait(rs[v], (i // STAGES) & 1)
    cg, cu = _stage_codes(ws[v], BN, BK, NW, DUAL)
    # One buffer per part: the compiler puts a CTA barrier before these stores (the last step's wgmmas read them).
    # Stored as int32 words (4 e4m3 values each): as bytes the compiler unpacks and repacks them.
    hi_buf._reinterpret(gl.int32, [ROWS, BK // 4], words_sl).store(act_hi)
    lo_buf._reinterpret(gl.int32, [ROWS, BK // 4], words_sl).store(act_lo)
    fence_async_shared()
    # The activation parts are complete, every warp has read stage v - 1 (refilled now) and waited on stage v.
    cta_barrier()
    prev: gl.constexpr = (v + STAGES - 1) % STAGES
    refill = i + STAGES - 1
    tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, refill * BK, DUAL), rs[prev], ws[prev],
                                    pred=(i >= 1) & (refill < n_steps))
    mbarrier.expect(rs[v], w_desc.block_type.nbytes, pred=i + STAGES < n_steps)
    g, u, pending = _step_mmas(_block_codes(cg, BN), _block_codes(cu, BN), hi_buf, lo_buf, sc_g, sc_u, g, u, pending,
                               a_l, MMA, DUAL)
    return sc_g_nx, sc_u_nx, act_hi_nx, act_lo_nx, g, u, pending


@gluon.jit
def fp8_mainloop(w_desc, w_row, sg_ptrs, su_ptrs, a_hi_ptrs, a_lo_ptrs, a_mask, K, ROWS: gl.constexpr,
                 BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr, DUAL: gl.constexpr):
    """The FP32 sums [BN, ROWS] of the tile (and of the up tile if DUAL) over K, times 2^-6 per activation factor:
    sg_ptrs / su_ptrs the int32 scale words (4 E8M0 bytes per row and step) at k = 0, a_hi_ptrs / a_lo_ptrs the
    activation parts' int32 words [ROWS, BK / 4] at k = 0 (kappa order), a_mask their rows."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 32])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    hi_buf = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BK], b_sl)
    lo_buf = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BK], b_sl)
    ws, rs = _alloc_ring(w_desc, STAGES)
    for st in gl.static_range(STAGES):
        mbarrier.init(rs[st], count=1)
    n_steps = K // BK
    for st in gl.static_range(STAGES):
        mbarrier.expect(rs[st], w_desc.block_type.nbytes, pred=st < n_steps)
        tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, st * BK, DUAL), rs[st], ws[st], pred=st < n_steps)
    g = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    u = g
    no_scale = gl.zeros([BN], gl.int32, layout=gl.SliceLayout(1, mma_l))  # byte 0: a factor of 0
    pending = (g, g, no_scale, no_scale)
    sc_g = gl.load(sg_ptrs)
    sc_u = sc_g
    if DUAL:
        sc_u = gl.load(su_ptrs)
    act_hi = gl.load(a_hi_ptrs, mask=a_mask, other=0)
    act_lo = gl.load(a_lo_ptrs, mask=a_mask, other=0)
    for i0 in range(0, n_steps, STAGES):
        for v in gl.static_range(STAGES):
            sc_g, sc_u, act_hi, act_lo, g, u, pending = _fp8_step(
                v, i0 + v, ws, rs, hi_buf, lo_buf, w_desc, w_row, sg_ptrs, su_ptrs, a_hi_ptrs, a_lo_ptrs, a_mask, K,
                n_steps, sc_g, sc_u, act_hi, act_lo, g, u, pending, ROWS, BN, BK, NW, MMA, DUAL)
    if MMA == "block":  # the last block's scaled adds
        tg, tu, sc_p, su_p = pending
        g, u = _scaled_add(g, u, tg, tu, sc_p, su_p, 3, DUAL)
    return g, u
