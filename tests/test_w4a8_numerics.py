"""The W4A8 numerics (ops/routed/w4a8_numerics.py): activation blocks and weight expansion against their definitions,
the blockwise product against float64, the routed op's exact form against the float64 reference, the W4A8 form within
its documented bound, and bad inputs refused with a reason."""

import pytest
import torch

from latent_moe_fusion.ops.common.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from latent_moe_fusion.ops.routed.w4a8_numerics import (
    ACT_BLOCK,
    WEIGHT_BLOCK_ROWS,
    block_exponents,
    blockwise_matmul64,
    expand_mxfp4_to_e4m3,
    quantize_activations,
    routed_experts64,
)
from tests.float64_reference import routed64

W4A8_REL_L2_BOUND = 6e-2  # docs/numerics.md: ~4.3e-2 measured at Kimi K3's L and I (bench/w4a8_numerics.py)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_activation_blocks_keep_their_largest_value_and_e4m3_precision(rng_seed):
    x = torch.randn(6, 4 * ACT_BLOCK) * torch.logspace(-3, 3, 4).repeat_interleave(ACT_BLOCK)  # blocks of every size
    x[2, ACT_BLOCK:2 * ACT_BLOCK] = 0.0
    values, scales = quantize_activations(x.to(torch.bfloat16))
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (6, 4)
    back = values.float().reshape(6, 4, ACT_BLOCK) * scales.unsqueeze(-1)
    blocks = x.to(torch.bfloat16).float().reshape(6, 4, ACT_BLOCK)
    assert torch.equal(values.float().reshape(6, 4, ACT_BLOCK).abs().amax(-1)[scales != 1], torch.full_like(
        scales[scales != 1], 448.0))
    assert scales[2, 1] == 1 and not back[2, 1].any()
    assert ((back - blocks).abs() <= blocks.abs() * 2**-4 + 2**-9 * scales.unsqueeze(-1)).all()  # e4m3: 3 bits


def test_expanded_weights_are_the_mxfp4_weights(rng_seed):
    w = torch.randn(2, 128, 2 * ACT_BLOCK) * torch.logspace(-2, 1, 8).repeat_interleave(32)  # exponents 8 apart at most
    w[:, 64:] *= 4.0  # the second row block's exponents two higher
    packed, scales = quantize_mxfp4(w)
    values, block_scales = expand_mxfp4_to_e4m3(packed, scales)
    assert values.shape == w.shape and block_scales.shape == (2, 2, 2)
    rows = block_scales.repeat_interleave(WEIGHT_BLOCK_ROWS, dim=-2).repeat_interleave(ACT_BLOCK, dim=-1)
    exps = scales.int().reshape(2, 2, 64, 2, 4).permute(0, 1, 3, 2, 4).reshape(2, 2, 2, 256)
    assert int((exps.amax(-1) - exps.amin(-1)).max()) <= 8
    assert torch.equal(block_exponents(scales).int(), exps.amax(-1))
    assert torch.equal(values.float() * rows, dequantize_mxfp4(packed, scales))


def test_exponents_farther_apart_than_e4m3_reaches_round_the_smaller_values():
    packed = torch.full((WEIGHT_BLOCK_ROWS, ACT_BLOCK // 2), 0x11, dtype=torch.uint8)  # every value 0.5
    scales = torch.full((WEIGHT_BLOCK_ROWS, 4), 127, dtype=torch.uint8)
    scales[5, 0] = 127 + 10  # one 2^10 beside 2^0 in the block: every other value shifts by 10
    values, block_scales = expand_mxfp4_to_e4m3(packed, scales)
    expanded = values.float() * block_scales.repeat_interleave(WEIGHT_BLOCK_ROWS, 0).repeat_interleave(ACT_BLOCK, -1)
    exact = dequantize_mxfp4(packed, scales)
    assert torch.equal(expanded[5, :32], exact[5, :32]) and not torch.equal(expanded[5, 32:], exact[5, 32:])
    assert not torch.equal(expanded[0], exact[0])


def test_the_blockwise_product_is_the_product_of_the_dequantised_operands(rng_seed):
    a, a_scales = quantize_activations(torch.randn(5, 3 * ACT_BLOCK))
    w, w_scales = expand_mxfp4_to_e4m3(*quantize_mxfp4(torch.randn(128, 3 * ACT_BLOCK)))
    dense_a = a.double() * a_scales.double().repeat_interleave(ACT_BLOCK, dim=1)
    dense_w = w.double() * w_scales.double().repeat_interleave(WEIGHT_BLOCK_ROWS, 0).repeat_interleave(ACT_BLOCK, 1)
    assert torch.allclose(blockwise_matmul64(a, a_scales, w, w_scales), dense_a @ dense_w.t(), rtol=1e-12, atol=0)


def _problem(m: int = 24, latent: int = 256, inter: int = 384, experts: int = 6, top_k: int = 3):
    z = torch.randn(m, latent).to(torch.bfloat16)
    p13, s13 = quantize_mxfp4(torch.randn(experts, 2 * inter, latent) / latent**0.5)
    p2, s2 = quantize_mxfp4(torch.randn(experts, latent, inter) / inter**0.5)
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(m)]).to(torch.int32)
    ids[0, 0] = -1  # another rank's expert: skipped
    return z, ids, torch.rand(m, top_k), p13, p2, s13, s2


def test_the_exact_form_is_the_float64_reference(rng_seed):
    z, ids, weights, p13, p2, s13, s2 = _problem()
    exact = routed_experts64(z, ids, weights, p13, p2, s13, s2, 4.0, 25.0, w4a8=False)
    assert _rel(exact, routed64(z, ids, weights, p13, p2, s13, s2, "mxfp4", 4.0, 25.0)) < 1e-12


def test_the_w4a8_form_stays_within_its_documented_bound(rng_seed):
    z, ids, weights, p13, p2, s13, s2 = _problem()
    exact = routed_experts64(z, ids, weights, p13, p2, s13, s2, 4.0, 25.0, w4a8=False)
    w4a8 = routed_experts64(z, ids, weights, p13, p2, s13, s2, 4.0, 25.0, w4a8=True)
    err = _rel(w4a8, exact)
    assert 1e-3 < err < W4A8_REL_L2_BOUND, err  # e4m3's 3 bits cost percent, not the bf16 path's tenths


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"K = 96 must be a multiple of 128"):
        quantize_activations(torch.randn(2, 96))
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        quantize_activations(torch.randn(2, 3, 128))
    packed, scales = quantize_mxfp4(torch.randn(64, 96))
    with pytest.raises(ValueError, match=r"K = 96 must be a multiple of 128"):
        expand_mxfp4_to_e4m3(packed, scales)
    with pytest.raises(TypeError, match="must be uint8"):
        expand_mxfp4_to_e4m3(packed.float(), scales)
    packed, scales = quantize_mxfp4(torch.randn(64, 128))
    with pytest.raises(ValueError, match="does not match packed"):
        expand_mxfp4_to_e4m3(packed, scales[:, :2])
    packed, scales = quantize_mxfp4(torch.randn(32, 128))
    with pytest.raises(ValueError, match="32 weight rows must be a multiple of 64"):
        expand_mxfp4_to_e4m3(packed, scales)
