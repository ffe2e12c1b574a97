"""The W4A8 path on the CPU: the e2m1 -> e4m3 expansion's asm text (the CPU emulator) against the definition's
shifted codes, the activation quantiser under the interpreter bit for bit against its definition, the weights' block
exponents (kept per tensor, recomputed after an in-place update), the plan's choice with LMF_ROUTED_W4A8 (taken on the
staged prefill blocks, refused with a reason elsewhere), and bad inputs."""

import pytest
import torch

from latent_moe_fusion import envs
from latent_moe_fusion.ops.common.mxfp4 import e2m1_lut, quantize_mxfp4
from latent_moe_fusion.ops.routed.gluon.routed_w4a8 import FP4_TO_E4M3_LUT_ASM, SHIFTS, shift_tables
from latent_moe_fusion.ops.routed.routed_plan import plan_routed
from latent_moe_fusion.ops.routed.triton.quantize_1x128 import quantize_1x128
from latent_moe_fusion.ops.routed.w4a8_numerics import ACT_BLOCK, block_exponents, quantize_activations
from latent_moe_fusion.ops.routed.w4a8_path import (
    block_exponents_of,
    clear_block_exponents,
    launch_l1_w4a8,
    w4a8_shape_reason,
)
from tests.ptx_emulator import run_ptx


def _expand(word: int, d: int) -> list[int]:
    lo, hi = shift_tables(torch.device("cpu"))[min(d, SHIFTS - 1)].tolist()
    out = run_ptx(FP4_TO_E4M3_LUT_ASM, {2: word, 3: lo, 4: hi}, 2)
    return [(out[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(8)]


@pytest.mark.parametrize("d", [0, 1, 3, 6, 8, 9, 10, 14, 20, 28, 29, 31, 40])
def test_the_expansion_asm_gives_the_definitions_e4m3_bytes(d, rng_seed):
    lut = e2m1_lut(torch.device("cpu"))
    words = [0x00000000, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98, 0x88888888] + \
        torch.randint(0, 2**32, (40,), dtype=torch.int64).tolist()
    for word in words:
        codes = torch.tensor([(word >> (4 * i)) & 0xF for i in range(8)])
        want = (lut[codes] * 2.0**-d).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
        assert _expand(word, d) == want, (hex(word), d)


@pytest.mark.parametrize("rows,k", [(3, 128), (7, 384), (2, 3584)])
def test_the_quantiser_gives_the_definitions_bits_under_the_interpreter(rows, k, rng_seed):
    x = (torch.randn(rows, k) * torch.logspace(-6, 6, k // ACT_BLOCK).repeat_interleave(ACT_BLOCK)).to(torch.bfloat16)
    x[0, :ACT_BLOCK] = 0
    x[-1, -5:] = torch.tensor([448.0, -448.0, 2.0**-12, -(2.0**-15), 1e-30])
    values, scales = quantize_1x128(x)
    want_v, want_s = quantize_activations(x)
    assert torch.equal(values.view(torch.uint8), want_v.view(torch.uint8)) and torch.equal(scales, want_s)
    values, scales = quantize_1x128(x.float())  # FP32 rows too
    want_v, want_s = quantize_activations(x.float())
    assert torch.equal(values.view(torch.uint8), want_v.view(torch.uint8)) and torch.equal(scales, want_s)


def test_the_quantiser_skips_rows_that_hold_no_pair(rng_seed):
    x = torch.randn(4, 256).to(torch.bfloat16)
    live = torch.tensor([3, -1, 0, -1], dtype=torch.int32)
    values, scales = quantize_1x128(x, live)
    want_v, want_s = quantize_activations(x)
    assert torch.equal(values[[0, 2]].view(torch.uint8), want_v[[0, 2]].view(torch.uint8))
    assert torch.equal(scales[[0, 2]], want_s[[0, 2]])


def test_block_exponents_are_kept_per_tensor_and_follow_in_place_updates(rng_seed):
    clear_block_exponents()
    _, other = quantize_mxfp4(torch.randn(2, 128, 256))
    block_exponents_of(other)
    del other  # a freed tensor's storage may come back to the next one: its entry must not
    _, scales = quantize_mxfp4(torch.randn(2, 128, 256))
    first = block_exponents_of(scales)
    assert block_exponents_of(scales) is first and torch.equal(first, block_exponents(scales))
    scales[0, 3, 0] = 200  # an in-place update bumps the version
    again = block_exponents_of(scales)
    assert again is not first and int(again[0, 0, 0]) == 200


def test_the_plan_takes_w4a8_on_the_staged_blocks_only(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the plan of a GPU process
    monkeypatch.setenv("LMF_ROUTED_W4A8", "1")
    prefill = plan_routed(16384, 16, 112, 3584, 3072)
    assert prefill.family == "staged" and prefill.w4a8
    assert any(d.name == "activations" and d.value == "w4a8" for d in prefill.decisions)
    decode = plan_routed(8, 16, 112, 3584, 3072)
    assert not decode.w4a8 and any("prefill blocks only" in d.reason for d in decode.decisions if d.name ==
                                   "activations")
    odd = plan_routed(16384, 16, 112, 3584, 3328)  # I not a multiple of 512
    assert not odd.w4a8 or odd.family != "staged"
    monkeypatch.delenv("LMF_ROUTED_W4A8")
    assert not plan_routed(16384, 16, 112, 3584, 3072).w4a8  # off by default: the default numerics stay


def test_shape_reasons_say_why():
    assert w4a8_shape_reason(3584, 3072, "mxfp4", torch.bfloat16, (9, 0)) is None
    assert "multiples of 512" in w4a8_shape_reason(3584, 3200, "mxfp4", torch.bfloat16, (9, 0))
    assert "sm_90" in w4a8_shape_reason(3584, 3072, "mxfp4", torch.bfloat16, (10, 0))
    assert "MXFP4" in w4a8_shape_reason(3584, 3072, "bf16", torch.bfloat16, (9, 0))
    assert "bfloat16" in w4a8_shape_reason(3584, 3072, "mxfp4", torch.float16, (9, 0))


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="LMF_ROUTED_W4A8='yes'"):
        envs.entry("LMF_ROUTED_W4A8").parse("LMF_ROUTED_W4A8", "yes")
    with pytest.raises(ValueError, match="K a multiple of 128"):
        quantize_1x128(torch.randn(2, 100))
    with pytest.raises(ValueError, match="live must be int32"):
        quantize_1x128(torch.randn(2, 128), torch.zeros(2, dtype=torch.int64))
    packed, scales = quantize_mxfp4(torch.randn(2, 128, 512))
    z = torch.randn(4, 512).to(torch.bfloat16)
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        launch_l1_w4a8(z, packed, scales, torch.zeros(128, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       torch.empty(128, 64), 1, 1, 4.0, 25.0)
