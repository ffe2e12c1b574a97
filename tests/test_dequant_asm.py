"""The inline-PTX MXFP4 dequantisers, run on the CPU through tests/ptx_emulator.py: every e2m1 code
at every position of a packed word must come out as the exact bf16 value, in k order."""

import numpy as np
import pytest

from latent_moe_fusion.ops.routed.gluon.lut_dequant import FP4_LUT8_ASM
from latent_moe_fusion.ops.routed.triton.weight_tiles import FP4_LUT_ASM, FP4_PAIRS_ASM
from tests.ptx_emulator import _bf16_bits_to_f32, run_ptx

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def expected_bf16_bits(code: int) -> int:
    value = np.float32(-E2M1[code & 7] if code & 8 else E2M1[code & 7])
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0]) >> 16  # exact in bf16


def words():
    rng = np.random.default_rng(0)
    structured = [c * 0x11111111 for c in range(16)]  # one code everywhere
    structured += [sum(((k + s) % 16) << (4 * k) for k in range(8)) for s in range(16)]  # all codes, all slots
    return structured + [int(w) for w in rng.integers(0, 2**32, size=300, dtype=np.uint64)]


@pytest.mark.parametrize("asm", [FP4_PAIRS_ASM, FP4_LUT_ASM], ids=["pairs", "lut"])
def test_every_code_at_every_position(asm):
    for w in words():
        out = run_ptx(asm, {4: w}, 4)
        for k in range(8):
            got = (out[k // 2] >> (16 * (k % 2))) & 0xFFFF
            code = (w >> (4 * k)) & 0xF
            assert got == expected_bf16_bits(code), f"word {w:#010x} k {k} code {code}: {got:#06x}"


def scaled_bf16_bits(code: int, scale: int) -> int:
    """bf16 bits of e2m1(code) * 2^(scale - 127), exact (scale byte 0 gives 0)."""
    value = np.float32(-E2M1[code & 7] if code & 8 else E2M1[code & 7]) * np.float32(2.0 ** (scale - 127) if scale else 0.0)
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0]) >> 16


def test_lut8_gives_every_code_times_its_scale_as_16_bit_outputs():
    """The Gluon kernels' dequantiser: $8 = word, $9 = E8M0 byte; $i = code i of the word, scaled."""
    rng = np.random.default_rng(1)
    scales = [0, 1, 100, 127, 128, 140, 200] + [int(s) for s in rng.integers(90, 160, size=20)]
    for i, w in enumerate(words()):
        scale = scales[i % len(scales)]
        out = run_ptx(FP4_LUT8_ASM, {8: w, 9: scale}, 8)
        for k in range(8):
            code = (w >> (4 * k)) & 0xF
            expected = scaled_bf16_bits(code, scale)
            if scale == 0:
                expected &= 0x8000  # 2^-127 is taken as 0 (see weight_tiles): a signed zero
            assert out[k] == expected, f"word {w:#010x} scale {scale} k {k} code {code}: {out[k]:#06x}"


def test_emulator_prmt_matches_the_ptx_manual_examples():
    from tests.ptx_emulator import _prmt

    a, b = 0x33221100, 0x77665544
    assert _prmt(a, b, 0x3210) == a and _prmt(a, b, 0x7654) == b
    assert _prmt(a, b, 0x5140) == (0x55 << 24) | (0x11 << 16) | (0x44 << 8) | 0x00
    assert _prmt(0x00000080, 0, 0x0008) & 0xFF == 0xFF  # sign-replicate mode


def test_pairs_bf16_gives_every_code_times_its_scale_within_the_window():
    """The wgmma kernels' dequantiser: $8 = word, $9 = the bf16x2 factor 2^(s - 1 - WINDOW) dequant_kappa
    makes of the E8M0 byte s; $i = code i times 2^(s - 127 - WINDOW). Exact for s in SCALE_BYTES_EXACT, rounded
    towards 0 below (bf16 subnormals), never finite above (inf / NaN): every byte, every code and position."""
    from latent_moe_fusion.ops.routed.gluon.lut_dequant import FP4_PAIRS_BF16_ASM, SCALE_BYTES_EXACT, WINDOW

    lo, hi = SCALE_BYTES_EXACT
    for scale in range(256):
        factor = min(scale + 126 - WINDOW, 255) * 0x00800080  # as dequant_kappa computes it
        for w in words()[:40]:
            out = run_ptx(FP4_PAIRS_BF16_ASM, {8: w, 9: factor}, 8)
            for k in range(8):
                code = (w >> (4 * k)) & 0xF
                got = np.float32(_bf16_bits_to_f32(out[k]))
                exact = np.float32(-E2M1[code & 7] if code & 8 else E2M1[code & 7]) * np.float32(2.0 ** (scale - 127))
                if lo <= scale <= hi:
                    assert got * np.float32(2.0**WINDOW) == exact, f"word {w:#010x} scale {scale} k {k}: {got}"
                elif scale < lo:
                    assert abs(float(got) * 2.0**WINDOW - float(exact)) <= 2.0 ** (-133 + WINDOW - 1), (scale, k)
                else:
                    assert not np.isfinite(got), f"scale {scale} k {k} code {code}: finite {got}"

