import pytest
import torch

from latent_moe_fusion.ops.common.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.float64_reference import E2M1_MAGNITUDES, decode_mxfp4


def _gen(rng_seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(rng_seed)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Independent packing: byte j = code[2j] | code[2j+1] << 4."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def _one_block(values: list[float]) -> torch.Tensor:
    """A [1, 32] row: `values` then zeros."""
    row = torch.zeros(1, 32)
    row[0, : len(values)] = torch.tensor(values)
    return row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_of_representable_values(rng_seed, dtype):
    gen = _gen(rng_seed)
    # Per 32-block of K: block 0 any code, block 1 magnitudes <= 3, block 2 <= 0.5, block 3 any code.
    top = torch.tensor([8, 6, 2, 8]).reshape(1, 1, 4, 1)
    magnitude = (torch.rand(3, 8, 4, 32, generator=gen) * top).long()
    sign = torch.randint(0, 2, (3, 8, 4, 32), generator=gen)
    packed = _pack((magnitude | (sign << 3)).to(torch.uint8).reshape(3, 8, 128))
    scales = torch.randint(100, 150, (3, 8, 4), generator=gen, dtype=torch.uint8)
    w = dequantize_mxfp4(packed, scales, dtype)
    assert w.dtype == dtype and w.shape == (3, 8, 128)
    assert torch.equal(w.double(), decode_mxfp4(packed, scales))  # exact in fp32 and bf16

    packed2, scales2 = quantize_mxfp4(w)
    assert packed2.shape == packed.shape and scales2.shape == scales.shape
    assert torch.equal(dequantize_mxfp4(packed2, scales2, dtype), w)

    # Blocks whose largest magnitude code is 4 or 6 (e2m1 exponent 2) keep their scale and codes;
    # negative zero (code 8) comes back as +0 (code 0).
    codes = _codes(packed).reshape(3, 8, 4, 32)
    max_code = (codes & 0x7).amax(dim=-1)
    kept = max_code >= 6
    assert kept.any() and (~kept).any()
    assert torch.equal(scales2[kept], scales[kept])
    expected_codes = torch.where(codes == 8, torch.zeros_like(codes), codes)
    assert torch.equal(_codes(packed2).reshape(3, 8, 4, 32)[kept], expected_codes[kept])


def test_packing_order_low_nibble_is_even_element():
    w = _one_block([1.0, 6.0, -0.5, 3.0])  # codes 2, 7, 9, 5
    packed, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127]]
    assert packed[0, :2].tolist() == [0x72, 0x59]
    assert torch.equal(packed[0, 2:], torch.zeros(14, dtype=torch.uint8))
    assert dequantize_mxfp4(packed, scales)[0, :4].tolist() == [1.0, 6.0, -0.5, 3.0]


def test_packing_of_every_code(rng_seed):
    codes = torch.randperm(16, generator=_gen(rng_seed)).repeat(4).reshape(2, 32).to(torch.uint8)
    packed = _pack(codes)
    scales = torch.full((2, 1), 127, dtype=torch.uint8)
    lut = [*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES)]
    expected = torch.tensor([[lut[c] for c in row] for row in codes.tolist()])
    assert torch.equal(dequantize_mxfp4(packed, scales), expected)


@pytest.mark.parametrize("scale_exp", [0, -3, 5])
def test_rounding_ties_to_even(scale_exp):
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    nearest_even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # the neighbour with an even code (mantissa bit 0)
    others = [0.3, 0.7, 2.6, 4.9, 5.1]
    others_nearest = [0.5, 0.5, 3.0, 4.0, 6.0]
    values = [6.0, *ties, *(-v for v in ties), *others]
    expected = [6.0, *nearest_even, *(-v for v in nearest_even), *others_nearest]
    scale = 2.0**scale_exp
    packed, scales = quantize_mxfp4(_one_block(values) * scale)
    assert scales.tolist() == [[127 + scale_exp]]
    out = dequantize_mxfp4(packed, scales)[0, : len(values)]
    assert out.tolist() == [v * scale for v in expected]


def test_saturation_at_six():
    # amax 7.5 -> scale 2**(floor(log2 7.5) - 2) = 1, so 7 and 7.5 saturate to 6.
    packed, scales = quantize_mxfp4(_one_block([7.0, -7.5, 6.5, 1.0]))
    assert scales.tolist() == [[127]]
    assert dequantize_mxfp4(packed, scales)[0, :4].tolist() == [6.0, -6.0, 6.0, 1.0]


def test_nearest_grid_point_on_random_weights(rng_seed):
    w = torch.randn(4, 16, 96, generator=_gen(rng_seed)) * 0.05
    packed, scales = quantize_mxfp4(w)
    dq = dequantize_mxfp4(packed, scales).double()
    # Every element lands on the nearest point of its block's grid (saturating at +-6 * scale).
    block_scale = torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)
    grid = torch.tensor([*E2M1_MAGNITUDES, *(-v for v in E2M1_MAGNITUDES)], dtype=torch.float64)
    nearest = ((w.double() / block_scale).unsqueeze(-1) - grid).abs().amin(dim=-1) * block_scale
    assert torch.allclose((dq - w.double()).abs(), nearest, rtol=0, atol=1e-12)
    # The block scale is 2**(floor(log2 amax) - 2): the largest element maps into [4, 8).
    amax = w.abs().reshape(4, 16, 3, 32).amax(dim=-1).double()
    ratio = amax / torch.pow(2.0, scales.double() - 127)
    assert ((ratio >= 4) & (ratio < 8)).all()


def test_all_zero_blocks():
    w = torch.zeros(2, 64)
    w[0, :32] = -0.0
    w[1, 40] = 3.0  # block 1 of row 1 is not zero
    packed, scales = quantize_mxfp4(w)
    assert scales[0].tolist() == [0, 0] and scales[1, 0].item() == 0
    assert torch.equal(packed[0], torch.zeros(32, dtype=torch.uint8))
    assert torch.equal(dequantize_mxfp4(packed, scales), w)


def test_nan_scale_byte_gives_nan():
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8)
    out = dequantize_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert out.isnan().all()


def test_errors():
    with pytest.raises(TypeError, match="w must be a floating tensor"):
        quantize_mxfp4(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="K = 48 is not divisible by 32"):
        quantize_mxfp4(torch.ones(2, 48))
    with pytest.raises(TypeError, match="packed and scales must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="packed and scales must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"scales shape \(2, 2\) does not match packed"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"scales shape \(3, 1\) does not match packed"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8))
