"""Routed MXFP4 L1 on FP8 MMAs (opt-in, decode; Gluon, sm_90): the e2m1 codes placed as e4m3, the activations
split per token into two e4m3 parts, the E8M0 scales applied to the FP32 sums of each 32-wide k block.

Why: the bf16 register-dequant kernels (routed_gemm.py) are bound by the dequantiser's instruction count, not by
their bytes (bench/results/producer_notes.md, run 17): 17 instructions per weight word, 9 of them on the
half-rate ALU pipe. Here a word (8 codes of one row) becomes two wgmma registers in 7 (5 ALU):

- e2m1 -> e4m3 is a bit placement: sign to bit 7, the magnitude bits (e1 e0 m) to bits 4..2. The byte then reads
  as the code times 2^-6 (code 0.5, the one e2m1 subnormal, lands on an e4m3 subnormal: exact);
- the scale is a power of two per (row, 32 k): one FP32 multiply-add per accumulator and block folds it into the
  sums (``acc += 2^(s - 127) * block``), so the MMA covers exactly one scale block: k32 FP8 wgmmas;
- the activations are bf16; one e4m3 keeps 4 of their 8 significant bits, so each token is split once, outside
  the kernel, as z * 2^f = hi + lo (f a power of two per token putting its largest |z| at the top of e4m3's
  range): two MMAs per block on the same weight registers. Numerics: bench/results/fp8_split_numerics.md
  (~3e-5 from float64 against 1.6e-3 for rounding the output to bf16 once; not bitwise the bf16 path).

The k order inside a 32-block: the wgmma register for row r holds k 4q .. 4q + 3 (q = lane % 4) and another
k 16 + 4q .. 16 + 4q + 3. Thread q takes word q of the block (codes 8q .. 8q + 7 of the weight's own order); its
low nibbles (codes 8q + 2e) go to the first register and its high nibbles (8q + 2e + 1) to the second. So the
MMA's k (kappa) is 16 * (k % 2) + k // 2 inside each block: the activation split writes that order (fp8_split).

Thread q now reads word q of each of the step's 4 blocks (4-byte shared loads) instead of one 16-byte load: the
TMA ring's stages are 64-byte swizzled, which makes those loads conflict-free.
"""

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

from ..triton_kernels.numerics import situ
from .ring_loops import _alloc_ring, _ring_coord
from .routed_gemm import _valid_rows

# $2: 4 bytes of codes packed (pack=4: one register holds word q's 4 bytes); $0: their low nibbles as e4m3, $1 the
# high ones (bit placement, see the module doc). Low: magnitude << 2, sign << 4;
# high: magnitude >> 2, sign in place.
_E4M3_PAIRS_ASM = """
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
FP4_TO_E4M3_ASM = _E4M3_PAIRS_ASM  # the CPU emulator test reads it
_E4M3_TEXT = gl.constexpr(_E4M3_PAIRS_ASM)
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
def _issue(cg, cu, hi_buf, lo_buf, tg, tu, j: gl.constexpr, a_l: gl.constexpr):
    """Block j's four asynchronous MMAs (its gate and up codes expanded here, so that only the blocks in flight hold
    A registers): gate and up, each on both activation parts, into fresh FP32 sums."""
    BN: gl.constexpr = cg.shape[0]
    hi_b = hi_buf.slice(32 * j, 32, dim=1).permute((1, 0))
    lo_b = lo_buf.slice(32 * j, 32, dim=1).permute((1, 0))
    ag = gl.convert_layout(_block_operand(cg, BN), a_l, assert_trivial=True)
    au = gl.convert_layout(_block_operand(cu, BN), a_l, assert_trivial=True)
    tg = warpgroup_mma(ag, hi_b, tg, use_acc=False, is_async=True)
    tg = warpgroup_mma(ag, lo_b, tg, is_async=True)
    tu = warpgroup_mma(au, hi_b, tu, use_acc=False, is_async=True)
    tu = warpgroup_mma(au, lo_b, tu, is_async=True)
    return tg, tu


@gluon.jit
def _step_mmas(ags, aus, hi_buf, lo_buf, sc_g, sc_u, g, u, pending, a_l: gl.constexpr, MMA: gl.constexpr):
    """The step's 4 blocks: MMAs into fresh sums, then acc += scale * sums, scheduled as MMA says:
    - "block": block j's MMAs, then block j - 1's scaled adds (pending: the last step's block 3), then wait;
    - "pipe": block j + 1's MMAs go out before block j's wait (two blocks in flight), all done by the step's end;
    - "step": all 16 MMAs, one wait, then the scaled adds.
    The waits take the accumulators as dependencies: otherwise the compiler sinks every scaled add to the end of
    the step and keeps all blocks' sums live (255 registers)."""
    tg, tu, sg, su = pending
    if MMA == "block":
        for j in gl.static_range(4):
            tg0, tu0, sg0, su0 = tg, tu, sg, su
            tg, tu = _issue(ags[j], aus[j], hi_buf, lo_buf, tg0, tu0, j, a_l)
            g = g + sg0[:, None] * tg0
            u = u + su0[:, None] * tu0
            tg, tu, g, u = warpgroup_mma_wait(0, deps=[tg, tu, g, u])
            sg, su = _scale_factor(sc_g, j), _scale_factor(sc_u, j)
    elif MMA == "pipe":
        tg0, tu0 = _issue(ags[0], aus[0], hi_buf, lo_buf, tg, tu, 0, a_l)
        for j in gl.static_range(1, 4):
            tg1, tu1 = _issue(ags[j], aus[j], hi_buf, lo_buf, tg, tu, j, a_l)
            tg0, tu0, g, u = warpgroup_mma_wait(4, deps=[tg0, tu0, g, u])
            g = g + _scale_factor(sc_g, j - 1)[:, None] * tg0
            u = u + _scale_factor(sc_u, j - 1)[:, None] * tu0
            tg0, tu0 = tg1, tu1
        tg0, tu0, g, u = warpgroup_mma_wait(0, deps=[tg0, tu0, g, u])
        g = g + _scale_factor(sc_g, 3)[:, None] * tg0
        u = u + _scale_factor(sc_u, 3)[:, None] * tu0
    else:
        tg0, tu0 = _issue(ags[0], aus[0], hi_buf, lo_buf, tg, tu, 0, a_l)
        tg1, tu1 = _issue(ags[1], aus[1], hi_buf, lo_buf, tg, tu, 1, a_l)
        tg2, tu2 = _issue(ags[2], aus[2], hi_buf, lo_buf, tg, tu, 2, a_l)
        tg3, tu3 = _issue(ags[3], aus[3], hi_buf, lo_buf, tg, tu, 3, a_l)
        tg0, tu0, tg1, tu1, tg2, tu2, tg3, tu3 = warpgroup_mma_wait(0, deps=[tg0, tu0, tg1, tu1, tg2, tu2, tg3, tu3])
        g = g + _scale_factor(sc_g, 0)[:, None] * tg0 + _scale_factor(sc_g, 1)[:, None] * tg1
        g = g + _scale_factor(sc_g, 2)[:, None] * tg2 + _scale_factor(sc_g, 3)[:, None] * tg3
        u = u + _scale_factor(sc_u, 0)[:, None] * tu0 + _scale_factor(sc_u, 1)[:, None] * tu1
        u = u + _scale_factor(sc_u, 2)[:, None] * tu2 + _scale_factor(sc_u, 3)[:, None] * tu3
    return g, u, (tg, tu, sg, su)


@gluon.jit
def _fp8_step(v: gl.constexpr, i, ws, rs, hi_buf, lo_buf, w_desc, w_row, sg_ptrs, su_ptrs, a_hi_ptrs, a_lo_ptrs,
              a_mask, K, n_steps, sc_g, sc_u, act_hi, act_lo, g, u, pending, ROWS: gl.constexpr,
              BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    STAGES: gl.constexpr = 4
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 32])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=4)
    codes_l: gl.constexpr = bytes_layout(BN, NW)
    flat_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    words_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    # The next step's scales and activation parts (the last step reloads its own).
    k_nx = gl.multiple_of(gl.minimum((i + 1) * BK, K - BK), BK)
    sc_g_nx = gl.load(sg_ptrs + k_nx // 128)
    sc_u_nx = gl.load(su_ptrs + k_nx // 128)
    act_hi_nx = gl.load(a_hi_ptrs + k_nx // 4, mask=a_mask, other=0)
    act_lo_nx = gl.load(a_lo_ptrs + k_nx // 4, mask=a_mask, other=0)
    mbarrier.wait(rs[v], (i // STAGES) & 1)
    flat = ws[v]._reinterpret(gl.uint8, [2 * BN, BK // 2], flat_l)
    codes_g = flat.slice(0, BN).load(codes_l)
    codes_u = flat.slice(BN, BN).load(codes_l)
    # One buffer per part: the compiler puts a CTA barrier before these stores (the last step's wgmmas read them).
    # Stored as int32 words (4 e4m3 values each): as bytes the compiler unpacks and repacks them.
    hi_buf._reinterpret(gl.int32, [ROWS, BK // 4], words_sl).store(act_hi)
    lo_buf._reinterpret(gl.int32, [ROWS, BK // 4], words_sl).store(act_lo)
    fence_async_shared()
    gl.thread_barrier()
    prev: gl.constexpr = (v + STAGES - 1) % STAGES
    refill = i + STAGES - 1
    tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, refill * BK, True), rs[prev], ws[prev],
                                    pred=(i >= 1) & (refill < n_steps))
    mbarrier.expect(rs[v], w_desc.block_type.nbytes, pred=i + STAGES < n_steps)
    g, u, pending = _step_mmas(_block_codes(codes_g, BN), _block_codes(codes_u, BN), hi_buf, lo_buf, sc_g, sc_u, g, u,
                               pending, a_l, MMA)
    return sc_g_nx, sc_u_nx, act_hi_nx, act_lo_nx, g, u, pending


@gluon.jit
def _l1_fp8_rows(z_hi_ptr, z_lo_ptr, col_factor_ptr, s_ptr, w_desc, w_row, expert, sorted_ptr, act_ptr, row0, n0,
                 inter, K, row_scales, stride_se, top_k, beta, lin_beta, ROWS: gl.constexpr, BN: gl.constexpr,
                 BK: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    """act[row0 .. row0 + ROWS, n0 .. n0 + BN] = bf16(SiTU(gate, up)) of the rows' tokens."""
    STAGES: gl.constexpr = 4
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 32])
    act_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [NW, 1], [1, 0])  # int32 words: 4 e4m3 values each
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    # Scale words: a step's 4 E8M0 bytes per row as one int32, rows in the MMA's row layout (gate; up I rows on).
    rn = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    s_rows = s_ptr + expert.to(gl.int64) * stride_se + rn.to(gl.int64) * row_scales
    sg_ptrs = s_rows.to(gl.pointer_type(gl.int32), bitcast=True)
    su_ptrs = (s_rows + inter * row_scales).to(gl.pointer_type(gl.int32), bitcast=True)
    pos = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    pair = gl.load(sorted_ptr + pos)
    tok = gl.where(pair >= 0, pair // top_k, 0)
    ak = gl.arange(0, BK // 4, layout=gl.SliceLayout(0, act_l))
    a_off = tok[:, None].to(gl.int64) * (K // 4) + ak[None, :]
    a_mask = (pair >= 0)[:, None] & (ak >= 0)[None, :]
    a_hi_ptrs = z_hi_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + a_off
    a_lo_ptrs = z_lo_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + a_off
    hi_buf = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BK], b_sl)
    lo_buf = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, BK], b_sl)
    ws, rs = _alloc_ring(w_desc, STAGES)
    for st in gl.static_range(STAGES):
        mbarrier.init(rs[st], count=1)
    n_steps = K // BK
    for st in gl.static_range(STAGES):
        mbarrier.expect(rs[st], w_desc.block_type.nbytes, pred=st < n_steps)
        tma.async_copy_global_to_shared(w_desc, _ring_coord(w_row, st * BK, True), rs[st], ws[st], pred=st < n_steps)
    g = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    u = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    zero = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    no_scale = gl.zeros([BN], gl.float32, layout=gl.SliceLayout(1, mma_l))
    pending = (zero, zero, no_scale, no_scale)
    sc_g = gl.load(sg_ptrs)
    sc_u = gl.load(su_ptrs)
    act_hi = gl.load(a_hi_ptrs, mask=a_mask, other=0)
    act_lo = gl.load(a_lo_ptrs, mask=a_mask, other=0)
    for i0 in range(0, n_steps, STAGES):
        for v in gl.static_range(STAGES):
            sc_g, sc_u, act_hi, act_lo, g, u, pending = _fp8_step(
                v, i0 + v, ws, rs, hi_buf, lo_buf, w_desc, w_row, sg_ptrs, su_ptrs, a_hi_ptrs, a_lo_ptrs, a_mask, K,
                n_steps, sc_g, sc_u, act_hi, act_lo, g, u, pending, ROWS, BN, BK, NW, MMA)
    if MMA == "block":  # the last block's scaled adds
        tg, tu, sg, su = pending
        g = g + sg[:, None] * tg
        u = u + su[:, None] * tu
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l))
    opair = gl.load(sorted_ptr + om)
    factor = gl.load(col_factor_ptr + gl.where(opair >= 0, opair // top_k, 0))
    h = situ(g * factor[None, :], u * factor[None, :], beta, lin_beta)
    gl.store(act_ptr + om[None, :].to(gl.int64) * inter + on[:, None], h.to(act_ptr.dtype.element_ty))


@gluon.jit(do_not_specialize=["top_k"])
def l1_fp8_kernel(z_hi_ptr, z_lo_ptr, col_factor_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K,
                  row_scales, top_k, stride_se, beta, lin_beta, w_desc, BM: gl.constexpr, BK: gl.constexpr,
                  num_warps: gl.constexpr, MMA: gl.constexpr = "pipe"):
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    tiles_n = inter // BN
    pid = gl.program_id(0)
    blk = pid // tiles_n
    n0 = (pid % tiles_n) * BN
    expert = gl.load(block_expert_ptr + blk)
    if expert >= 0:
        w_row = (2 * expert, n0)
        args = (z_hi_ptr, z_lo_ptr, col_factor_ptr, s_ptr, w_desc, w_row, expert, sorted_ptr, act_ptr, blk * BM, n0,
                inter, K, row_scales, stride_se, top_k, beta, lin_beta)
        # The MMA's N: 8, 16 or 32 rows, the fewest that hold the block's valid rows (they come first). Fewer rows,
        # fewer scaled adds (one per accumulator and 32-block). 8-row blocks compile the 8-row path alone: at 128
        # registers, 4 CTAs per SM without spills.
        if BM == 8:
            _l1_fp8_rows(*args, 8, BN, BK, NW, MMA)
        else:
            valid = _valid_rows(sorted_ptr, blk * BM, BM, NW)
            if valid <= 8:
                _l1_fp8_rows(*args, 8, BN, BK, NW, MMA)
            elif BM == 16 or valid <= 16:
                _l1_fp8_rows(*args, 16, BN, BK, NW, MMA)
            else:
                _l1_fp8_rows(*args, 32, BN, BK, NW, MMA)
