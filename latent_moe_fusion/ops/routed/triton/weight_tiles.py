"""Weight tiles for the expert GEMMs: BF16/FP32 loads and MXFP4 dequantisation in the load path.

Hopper has no FP4 MMA, so an MXFP4 tile [BN, BK] is loaded packed (uint8 [BN, BK/2], low nibble
= even k) with its E8M0 scales (uint8 [BN, BK/32]) and expanded to the activation dtype right
before tl.dot. Five variants exist (chosen by DEQUANT):
  DEQUANT_TRITON      portable bit arithmetic in FP32 (also runs under TRITON_INTERPRET=1);
  DEQUANT_ASM         PTX on 32-bit words: 8 codes -> 4 bf16x2 with prmt/shift/and and two
                      exact bf16x2 multiplies (2^126 bias, then the block scale);
  DEQUANT_DOT_SCALED  tl.dot_scaled(e2m1 x bf16): Triton's own upcast (GPU only);
  DEQUANT_ASM_PAIRS   PTX, the bias trick on words already in k order;
  DEQUANT_LUT         PTX, table lookups with prmt (byte permute): the 8 e2m1 magnitudes' bf16
                      high and low bytes are two 8-byte tables, so 4 codes cost 2 prmt plus
                      2 more to interleave, and no bias multiply (~2.6 ALU ops per element vs
                      ~4.4 for ASM_PAIRS, before ptxas fuses logic ops). The sm_90 default:
                      3-6 % faster than ASM_PAIRS on the H200 (the loop is latency-bound,
                      docs/design/producer.md).
All of them give the exact value e2m1 * 2^(s - 127). The only corner they round differently from the
reference: E8M0 byte 0 (2^-127) is taken as 0 by the ASM path and may flush in the others.
"""

from __future__ import annotations

import triton
import triton.language as tl

DEQUANT_TRITON = 0
DEQUANT_ASM = 1
DEQUANT_DOT_SCALED = 2
DEQUANT_ASM_PAIRS = 3
DEQUANT_LUT = 4
# The same values as seen from inside @triton.jit code (globals there must be constexpr).
_ASM = tl.constexpr(DEQUANT_ASM)
_DOT_SCALED = tl.constexpr(DEQUANT_DOT_SCALED)
_ASM_PAIRS = tl.constexpr(DEQUANT_ASM_PAIRS)
_LUT = tl.constexpr(DEQUANT_LUT)


# PTX bodies of the inline-asm dequantisers (module constants so that tests/ptx_emulator.py can run
# the very text the GPU compiles). $4 holds 4 packed bytes = 8 codes, code k in bits 4k..4k+3;
# $0..$3 receive the bf16x2 pairs (k0, k1), (k2, k3), (k4, k5), (k6, k7).
# One bf16x2 pair per output word: prmt picks byte i's even code (low half) and odd code (high
# half), then the bias trick (see _fp4_pairs_to_bf16). Selectors for the pairs (k0, k1) .. (k6, k7).
_PAIR_WORD = """        prmt.b32 r, lo, hi, {sel};
        shl.b32 x, r, 6;
        and.b32 x, x, 0x01C001C0;
        shl.b32 y, r, 12;
        and.b32 y, y, 0x80008000;
        or.b32 x, x, y;
        mul.rn.bf16x2 ${out}, x, bias;
"""
FP4_PAIRS_ASM = (
    """
        {
        .reg .b32 lo, hi, bias, r, x, y;
        mov.b32 bias, 0x7E807E80;
        and.b32 lo, $4, 0x0F0F0F0F;
        shr.b32 hi, $4, 4;
        and.b32 hi, hi, 0x0F0F0F0F;
"""
    + "".join(_PAIR_WORD.format(sel=sel, out=out) for out, sel in enumerate(("0x5410", "0x6521", "0x7632", "0x4703")))
    + """        }
        """
)

# Table lookup: the low 16 bits of a prmt selector are 4 byte indices into the 8 bytes {b, a}.
# Indexed by the magnitude (code & 7): high bytes 00 3F 3F 3F 40 40 40 40 and low bytes
# 00 00 80 C0 00 40 80 C0 of bf16 0, .5, 1, 1.5, 2, 3, 4, 6. The sign of code k (bit 4k + 3) is bit 7
# of byte k/2 of (w << 4) for even k and of w for odd k: one prmt gathers 4 of them.
# One half per 4 codes: `idx` holds their magnitudes as prmt byte indices, `sel` gathers their sign
# bytes, and $lo / $hi receive the bf16x2 pairs.
_LUT_HALF = """        prmt.b32 hi, hi_a, hi_b, {idx};
        prmt.b32 lo, lo_a, lo_b, {idx};
        prmt.b32 sg, t, $4, {sel};
        and.b32 sg, sg, 0x80808080;
        or.b32 hi, hi, sg;
        prmt.b32 ${lo}, lo, hi, 0x5140;
        prmt.b32 ${hi}, lo, hi, 0x7362;
"""
FP4_LUT_ASM = (
    """
        {
        .reg .b32 m, m2, hi_a, hi_b, lo_a, lo_b, hi, lo, t, sg;
        mov.b32 hi_a, 0x3F3F3F00;
        mov.b32 hi_b, 0x40404040;
        mov.b32 lo_a, 0xC0800000;
        mov.b32 lo_b, 0xC0804000;
        and.b32 m, $4, 0x77777777;
        shr.b32 m2, m, 16;
        shl.b32 t, $4, 4;
"""
    + _LUT_HALF.format(idx="m", sel="0x5140", lo=0, hi=1)
    + _LUT_HALF.format(idx="m2", sel="0x7362", lo=2, hi=3)
    + """        }
        """
)

# Globals read inside @triton.jit code must be constexpr.
_PAIRS_ASM_TEXT = tl.constexpr(FP4_PAIRS_ASM)
_LUT_ASM_TEXT = tl.constexpr(FP4_LUT_ASM)


@triton.jit
def e2m1_to_fp32(codes):
    """uint8 4-bit codes -> FP32 values (sign bit 3, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    mag = (codes & 7).to(tl.uint32)
    # mag = 2e + m with e >= 1 is 2^(e-1) * (1 + m/2): exponent field e + 126, mantissa bit m.
    bits = (mag + 252) << 22
    bits = tl.where(mag == 1, 0x3F000000, bits)  # 0.5
    bits = tl.where(mag == 0, 0, bits)
    bits = bits | ((codes.to(tl.uint32) & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_fp32(scales):
    """uint8 E8M0 -> FP32 2^(s - 127) (byte 0 gives the subnormal 2^-127)."""
    s = scales.to(tl.uint32)
    bits = tl.where(s == 0, 0x00400000, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequant_triton(packed, scales, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    codes = tl.join(packed & 15, packed >> 4).reshape(BN, BK)
    values = e2m1_to_fp32(codes).reshape(BN, BK // 32, 32)
    values = values * e8m0_to_fp32(scales)[:, :, None]
    return values.reshape(BN, BK).to(DTYPE)


@triton.jit
def _fp4_bytes_to_bf16_asm(packed, scales):
    """Per packed byte: (low-nibble value, high-nibble value) in bf16, times 2^(scale byte - 127).

    Works on 4 bytes per 32-bit register. For bytes b0, b1 the word t = b0 << 8 | b1 << 24 holds the
    low nibbles at bits 8-11 / 24-27 and the high ones at 12-15 / 28-31; bf16 bits
    sign << 15 | (code & 7) << 6 are the e2m1 value times 2^-126 (subnormal for code 1), fixed by an
    exact bf16x2 multiply by 2^126, then by the block scale (bf16 bits s << 7).
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 z, bias, t, sc, x, y;
        mov.b32 z, 0;
        mov.b32 bias, 0x7E807E80;
        prmt.b32 t, $4, z, 0x1404;
        prmt.b32 sc, $5, z, 0x4140;
        shl.b32 sc, sc, 7;
        shr.b32 x, t, 2;
        and.b32 x, x, 0x01C001C0;
        shl.b32 y, t, 4;
        and.b32 y, y, 0x80008000;
        or.b32 x, x, y;
        mul.rn.bf16x2 x, x, bias;
        mul.rn.bf16x2 $0, x, sc;
        shr.b32 x, t, 6;
        and.b32 x, x, 0x01C001C0;
        and.b32 y, t, 0x80008000;
        or.b32 x, x, y;
        mul.rn.bf16x2 x, x, bias;
        mul.rn.bf16x2 $2, x, sc;
        prmt.b32 t, $4, z, 0x3424;
        prmt.b32 sc, $5, z, 0x4342;
        shl.b32 sc, sc, 7;
        shr.b32 x, t, 2;
        and.b32 x, x, 0x01C001C0;
        shl.b32 y, t, 4;
        and.b32 y, y, 0x80008000;
        or.b32 x, x, y;
        mul.rn.bf16x2 x, x, bias;
        mul.rn.bf16x2 $1, x, sc;
        shr.b32 x, t, 6;
        and.b32 x, x, 0x01C001C0;
        and.b32 y, t, 0x80008000;
        or.b32 x, x, y;
        mul.rn.bf16x2 x, x, bias;
        mul.rn.bf16x2 $3, x, sc;
        }
        """,
        constraints="=r,=r,=r,=r,r,r",
        args=[packed, scales],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _dequant_asm(packed, scales, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    # One scale byte per packed byte (16 packed bytes share a block scale).
    s = tl.broadcast_to(scales[:, :, None], (BN, BK // 32, 16)).reshape(BN, BK // 2)
    lo, hi = _fp4_bytes_to_bf16_asm(packed, s)
    return tl.join(lo, hi).reshape(BN, BK).to(DTYPE)


@triton.jit
def _fp4_pairs_to_bf16(packed, ASM: tl.constexpr):
    """4 packed bytes -> 8 bf16 values in k order: first output (k0, k1, k2, k3), second (k4..k7),
    by the PTX text ASM (FP4_PAIRS_ASM or FP4_LUT_ASM: same outputs).

    Pairs: L = w & 0x0F0F0F0F and H = (w >> 4) & 0x0F0F0F0F hold the even / odd codes of each byte;
    one prmt puts byte i's even code in the low half-word and its odd code in the high one, so each
    32-bit result is the bf16x2 pair (k = 2i, 2i + 1) and no register shuffle is needed after.
    LUT: the same words by table lookup, see FP4_LUT_ASM.
    """
    return tl.inline_asm_elementwise(
        asm=ASM,
        constraints="=r,=r,=r,=r,r",
        args=[packed],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _scaled_k_order(r0, r1, scales, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    """Outputs of a k-order pair dequantiser ((k0..k3), (k4..k7) per 4 packed bytes) as the [BN, BK]
    tile times the block scales. E8M0 -> bf16 2^(s - 127) is the byte in the exponent field (0 -> 0,
    see the module note)."""
    w = tl.join(r0, r1).reshape(BN, BK // 8, 4, 2).permute(0, 1, 3, 2).reshape(BN, BK // 32, 32)
    scale = (scales.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
    return (w * scale[:, :, None]).reshape(BN, BK).to(DTYPE)


@triton.jit
def _dequant_k_order(packed, scales, ASM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DTYPE: tl.constexpr):
    r0, r1 = _fp4_pairs_to_bf16(packed, ASM)
    return _scaled_k_order(r0, r1, scales, BN, BK, DTYPE)


@triton.jit
def _weight_bytes(w_ptr, rows, row_mask, col0, stride_w, desc, row0, COLS: tl.constexpr, WDESC: tl.constexpr):
    """[BN, COLS] stored elements from column col0: through a tensor descriptor (TMA: one copy per
    tile, no per-element addresses; rows past the tensor read as zero) or per-element pointers."""
    if WDESC:
        return desc.load([row0, col0])
    else:
        cols = col0 + tl.arange(0, COLS)
        return tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=row_mask[:, None], other=0)


@triton.jit
def load_weight_tile(
    w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s, desc, row0,
    BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr, DEQUANT: tl.constexpr, DTYPE: tl.constexpr,
    WDESC: tl.constexpr,
):
    """Rows `rows` [BN] (= row0 + 0..BN-1 of the descriptor's 2D view when WDESC), columns
    k0..k0+BK of one expert's weight, as a [BN, BK] tile in DTYPE."""
    if MXFP4:
        packed = _weight_bytes(w_ptr, rows, row_mask, k0 // 2, stride_w, desc, row0, BK // 2, WDESC)
        ks = k0 // 32 + tl.arange(0, BK // 32)
        scales = tl.load(s_ptr + rows[:, None] * stride_s + ks[None, :], mask=row_mask[:, None], other=127)
        if DEQUANT == _ASM:
            tile = _dequant_asm(packed, scales, BN, BK, DTYPE)
        elif DEQUANT == _ASM_PAIRS:
            tile = _dequant_k_order(packed, scales, _PAIRS_ASM_TEXT, BN, BK, DTYPE)
        elif DEQUANT == _LUT:
            tile = _dequant_k_order(packed, scales, _LUT_ASM_TEXT, BN, BK, DTYPE)
        else:
            tile = _dequant_triton(packed, scales, BN, BK, DTYPE)
    else:
        tile = _weight_bytes(w_ptr, rows, row_mask, k0, stride_w, desc, row0, BK, WDESC)
    return tile


@triton.jit
def load_packed_tile(w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s, desc, row0, BK: tl.constexpr,
                     WDESC: tl.constexpr):
    """Packed MXFP4 tile and its scales as stored (for tl.dot_scaled)."""
    packed = _weight_bytes(w_ptr, rows, row_mask, k0 // 2, stride_w, desc, row0, BK // 2, WDESC)
    ks = k0 // 32 + tl.arange(0, BK // 32)
    scales = tl.load(s_ptr + rows[:, None] * stride_s + ks[None, :], mask=row_mask[:, None], other=127)
    return packed, scales


@triton.jit
def mma(w, a, acc, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + w @ a with FP32 accumulation."""
    if INTERPRET:
        # tl.dot on bf16 operands is wrong under the interpreter (triton issue 11584).
        return tl.dot(w.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(w, a, acc, input_precision=DOT_PREC)


@triton.jit
def weight_step(
    w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s, a, acc, desc, row0,
    BN: tl.constexpr, BK: tl.constexpr, MXFP4: tl.constexpr, DEQUANT: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, WDESC: tl.constexpr,
):
    """acc + W[rows, k0:k0+BK] @ a, a [BK, BM] in the activation dtype (W through `desc` if WDESC)."""
    if MXFP4 and DEQUANT == _DOT_SCALED:
        packed, scales = load_packed_tile(w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s, desc, row0, BK, WDESC)
        return tl.dot_scaled(packed, scales, "e2m1", a, None, "bf16", acc, fast_math=True)
    else:
        w = load_weight_tile(w_ptr, s_ptr, rows, row_mask, k0, stride_w, stride_s, desc, row0,
                             BN, BK, MXFP4, DEQUANT, a.dtype, WDESC)
        return mma(w, a, acc, INTERPRET, DOT_PREC)


def dot_precision(is_fp32: bool) -> str | None:
    """FP32 models are checked tightly: full-precision FP32 dots instead of TF32."""
    return "ieee" if is_fp32 else None


__all__ = [
    "DEQUANT_ASM",
    "DEQUANT_ASM_PAIRS",
    "DEQUANT_DOT_SCALED",
    "DEQUANT_LUT",
    "FP4_LUT_ASM",
    "FP4_PAIRS_ASM",
    "DEQUANT_TRITON",
    "dot_precision",
    "e2m1_to_fp32",
    "e8m0_to_fp32",
    "load_weight_tile",
    "mma",
    "weight_step",
]
