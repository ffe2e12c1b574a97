"""MXFP4 -> BF16 in the registers of a wgmma A fragment (Gluon, sm_90).

A thread of the wgmma A layout (k_width 2) holds, per row and per 16-wide k chunk, the pairs
k = 2q + {0, 1} and 2q + 8 + {0, 1} (q = lane % 4). The GEMM's k order inside each 128-wide step is
free as long as the activations follow it, so the kernels use kappa (the MMA's k) with

    k     = 32 q + 8 w + 4 e + 2 h + c0      (the weight's own k, as stored: code c = 4 e + 2 h + c0 of word 4q + w)
    kappa = 32 w + 16 c0 + 8 h + 2 q + e

Thread q then owns k 32q .. 32q + 31 of its rows: 16 contiguous bytes (one 16-byte load) under one
E8M0 scale, in the standard [E, N, K/2] layout (no repacking). Each 32-bit word (8 codes, one
scale) becomes 8 BF16 values, two codes (i and i + 4, the wgmma register's pair) at a time, by bit
placement and one bf16x2 multiply (below: the wgmma kernels), or by table lookups (prmt on two 8-byte
tables of the e2m1 magnitudes' high and low bytes, the sign gathered by one more prmt: the GEMV
kernels' FP32 forms). The asm hands out 16-bit halves; joining them with the e (pair) index innermost
keeps every bf16x2 wgmma register one asm result, so no shuffles follow (checked in the SASS by the
compile test).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma

# One half of a word: 4 codes -> two bf16x2 pairs times the scale, each handed out as two outputs: 16-bit
# halves ({out}: "split"), or FP32 values, the bf16 bits widened ("f32": for CUDA-core FMAs, which take FP32
# operands; widening in the asm costs one shift or mask per value, while ptxas widened every odd 16-bit
# output with a prmt and a multiply in the GEMV kernels' static SASS).
_HALF = """        prmt.b32 hi, hi_a, hi_b, {idx};
        prmt.b32 lo, lo_a, lo_b, {idx};
        prmt.b32 sg, t, $8, {sel};
        and.b32 sg, sg, 0x80808080;
        or.b32 hi, hi, sg;
        prmt.b32 p, lo, hi, 0x5140;
{scale}{out01}        prmt.b32 p, lo, hi, 0x7362;
{scale}{out23}"""
_SCALE = "        mul.rn.bf16x2 p, p, sc;\n"
_SPLIT = "        mov.b32 {{${a}, ${b}}}, p;\n"
_F32 = "        shl.b32 ${a}, p, 16;\n        and.b32 ${b}, p, 0xFFFF0000;\n"


def _lut8_asm(out: str, scaled: bool = True) -> str:
    """$8: 8 codes (code i in bits 4i .. 4i + 3), $9: the E8M0 byte; $0 .. $7: code i's bf16 value times
    2^(scale - 127) (bf16 bits scale << 7; scale byte 0 gives 0, as the Triton dequantisers do).
    scaled=False: the code values alone ($9 unused), for kernels that apply the scale to FP32 sums."""
    form = _SPLIT if out == "split" else _F32

    def half(idx: str, sel: str, first: int) -> str:
        return _HALF.format(idx=idx, sel=sel, scale=_SCALE if scaled else "", out01=form.format(a=first, b=first + 1),
                            out23=form.format(a=first + 2, b=first + 3))

    return (
        """
        {
        .reg .b32 m, m2, hi_a, hi_b, lo_a, lo_b, hi, lo, t, sg, sc, p;
        mov.b32 hi_a, 0x3F3F3F00;
        mov.b32 hi_b, 0x40404040;
        mov.b32 lo_a, 0xC0800000;
        mov.b32 lo_b, 0xC0804000;
"""
        + ("        mul.lo.u32 sc, $9, 0x00800080;\n" if scaled else "")
        + """        and.b32 m, $8, 0x77777777;
        shr.b32 m2, m, 16;
        shl.b32 t, $8, 4;
"""
        + half("m", "0x5140", 0)
        + half("m2", "0x7362", 4)
        + """        }
        """
    )


FP4_LUT8_ASM = _lut8_asm("split")
FP4_LUT8_F32_ASM = _lut8_asm("f32")
FP4_LUT8_F32_UNSCALED_ASM = _lut8_asm("f32", scaled=False)
_LUT8_TEXT = gl.constexpr(FP4_LUT8_ASM)

_LUT8_F32_TEXT = gl.constexpr(FP4_LUT8_F32_ASM)
_LUT8_F32_UNSCALED_TEXT = gl.constexpr(FP4_LUT8_F32_UNSCALED_ASM)


@gluon.jit
def codes_to_f32(words, scales):
    """int32 words (8 codes each) and their int32 E8M0 bytes -> 8 FP32 tensors (code i of every word)."""
    return gl.inline_asm_elementwise(
        asm=_LUT8_F32_TEXT, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r", args=[words, scales],
        dtype=(gl.float32,) * 8, is_pure=True, pack=1,
    )


@gluon.jit
def codes_to_f32_unscaled(words):
    """int32 words (8 codes each) -> 8 FP32 tensors: code i's e2m1 value (no scale)."""
    return gl.inline_asm_elementwise(
        asm=_LUT8_F32_UNSCALED_TEXT, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[words],
        dtype=(gl.float32,) * 8, is_pure=True, pack=1,
    )


# The wgmma kernels' dequantiser: no table. A code's three magnitude bits (e1 e0 m) placed at bf16 bits 8..6
# (the exponent's two low bits and the mantissa's top bit) read as the code's value times 2^-126 (code 0.5
# the one subnormal), its sign at bit 15; one integer multiply by (2^a + 2^b) lays both copies out for two
# codes of a word at once (codes i and i + 4, one per 16-bit lane), one mask keeps the right bits. The bf16x2
# multiply by 2^(s - 1 - WINDOW) then gives code * 2^(s - 127) / 2^WINDOW, exact for scale bytes s in
# [59, 192] (below: rounded towards 0 as bf16 subnormals; above: inf / NaN, never a finite wrong value); the
# kernels multiply their FP32 sums by 2^WINDOW. Per word: 9 ALU-pipe instructions and 9 FMA-pipe ones (integer
# multiplies, bf16x2 multiplies) where the table takes 15 and 5: the ALU pipe throttled the table's kernels
# (Nsight Compute; docs/design/routed-dequantisation.md).
WINDOW = 64
WINDOW_SCALE = float(2**WINDOW)
SCALE_BYTES_EXACT = (WINDOW - 5, WINDOW + 128)  # s - 127 - WINDOW >= -133 + 1 for code 0.5; the factor < 2^128
_PAIR = """        and.b32 t, {src}, {mask};
        mul.lo.u32 t, t, {mult};
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 p{i}, t, $9;
"""
_PAIRS_ASM = (
    """
        {
        .reg .b32 w8, t, p0, p1, p2, p3;
        shr.b32 w8, $8, 8;
"""
    + _PAIR.format(src="$8", mask="0x000F000F", mult=4160, i=0)  # codes 0, 4: << 6 (magnitude), << 12 (sign)
    + _PAIR.format(src="$8", mask="0x00F000F0", mult=260, i=1)  # codes 1, 5: << 2, << 8
    + _PAIR.format(src="w8", mask="0x000F000F", mult=4160, i=2)  # codes 2, 6
    + _PAIR.format(src="w8", mask="0x00F000F0", mult=260, i=3)  # codes 3, 7
    + """        mov.b32 {$0, $4}, p0;
        mov.b32 {$1, $5}, p1;
        mov.b32 {$2, $6}, p2;
        mov.b32 {$3, $7}, p3;
        }
        """
)
FP4_PAIRS_BF16_ASM = _PAIRS_ASM  # $8: word, $9: bf16x2 factor; $i: code i (the CPU emulator test checks it)
_PAIRS_TEXT = gl.constexpr(_PAIRS_ASM)
_FACTOR_BIAS = gl.constexpr(126 - WINDOW)  # E8M0 byte -> bf16 exponent field of 2^(s - 1 - WINDOW)


@gluon.jit
def scale_factors(scales):
    """int32 E8M0 bytes -> the bf16x2 factors 2^(s - 1 - WINDOW) that codes_to_bf16 takes (inf from byte 255)."""
    return gl.minimum(scales + _FACTOR_BIAS, 255) * 0x00800080


@gluon.jit
def codes_to_bf16(words, factors):
    """int32 words (8 codes each), int32 bf16x2 factors 2^(s - 1 - WINDOW) -> 8 bf16 tensors (code i of every
    word times 2^(s - 127 - WINDOW)); codes i and i + 4 come out of one 32-bit register."""
    return gl.inline_asm_elementwise(
        asm=_PAIRS_TEXT, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r", args=[words, factors],
        dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
    )


@gluon.constexpr_function
def words_layout(BN, BK, NW):
    """int32 words [BN, BK/8]: thread q of a row holds words 4q .. 4q + 3 (16 bytes) and its rows are
    lane / 4 + {0, 8} of its warp's 16."""
    warp_bases = [[16, 0], [32, 0]] if NW == 4 else [[16, 0], [32, 0], [64, 0]]
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_bases, block_bases=[], shape=[BN, BK // 8])


@gluon.jit
def to_kappa(x, R: gl.constexpr, BK: gl.constexpr):
    """[R, BK] in k order -> the same values in kappa order (a bit permutation of the index)."""
    x = gl.reshape(x, [R, 4, 4, 2, 2, 2])  # (r, q, w, e, h, c0)
    x = gl.permute(x, [0, 2, 5, 4, 1, 3])  # (r, w, c0, h, q, e)
    return gl.reshape(x, [R, BK])


@gluon.jit
def kappa_position(k):
    """Where column k (of a row in k order) sits in kappa order: within its 128-wide chunk,
    32q + 8w + 4e + 2h + c0 -> 32w + 16c0 + 8h + 2q + e."""
    r = k % 128
    return k - r + 32 * ((r // 8) % 4) + 16 * (r % 2) + 8 * ((r // 2) % 2) + 2 * (r // 32) + (r // 4) % 2


@gluon.jit
def dequant_kappa(words, scales, BN: gl.constexpr, BK: gl.constexpr):
    """int32 words [BN, BK/8] (thread q: words 4q .. 4q + 3), int32 scale bytes per word ->
    [BN, BK] bf16 in kappa order, times 2^-WINDOW (the caller scales its FP32 sums back)."""
    o0, o1, o2, o3, o4, o5, o6, o7 = codes_to_bf16(words, scale_factors(scales))
    # Output c = 4 e + 2 h + c0 of its word. The e join comes last so that it is the innermost register
    # dimension: each bf16x2 wgmma register is then one asm register (codes i, i + 4).
    y0 = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [BN, W, c0, h] for e = 0
    y1 = gl.join(gl.join(o4, o5), gl.join(o6, o7))
    w = gl.join(y0, y1)  # [BN, W, c0, h, e], W = 4q + w
    w = gl.reshape(w, [BN, 4, 4, 2, 2, 2])  # (n, q, w, c0, h, e)
    w = gl.permute(w, [0, 2, 3, 4, 1, 5])  # (n, w, c0, h, q, e)
    return gl.reshape(w, [BN, BK])


@gluon.jit
def dequant_operand(words, scales, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """dequant_kappa(words, scales) as the register A operand of a wgmma with N = BM (the conversion to its layout
    must be free: assert_trivial)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    return gl.convert_layout(dequant_kappa(words, scales.to(gl.int32), BN, BK), a_l, assert_trivial=True)


@gluon.jit
def dequant_mma(words, scales, buf, acc, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """acc [BN, BM] += dequant_kappa(words, scales) @ buf^T: the dequantised tile straight from registers as
    the wgmma's A operand, the activation tile buf [BM, BK] (kappa order) from shared memory."""
    return warpgroup_mma(dequant_operand(words, scales, BM, BN, BK, NW), buf.permute((1, 0)), acc)
