"""bench/fp8_split_numerics.py: the FP8 hi + lo split of bf16 activations keeps the routed product far inside bf16
rounding, one FP8 part alone does not, and the e2m1 codes the model feeds are the MXFP4 values themselves."""

import torch

from bench.fp8_split_numerics import measure, split_activations, to_e4m3


def test_e2m1_values_are_exact_in_e4m3_and_the_split_rebuilds_most_activations():
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    assert torch.equal(to_e4m3(codes), codes) and torch.equal(to_e4m3(-codes), -codes)
    a = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    hi, lo, f = split_activations(a)
    exact = ((hi + lo) / f == a.to(torch.float64)).double().mean()
    assert exact > 0.99


def test_the_split_route_stays_far_inside_bf16_rounding():
    r = measure(64, 512, 4, 8.0, torch.Generator().manual_seed(2))
    assert r["bf16_path_rel_l2"] < 1e-6
    assert r["fp8_split_acc14_rel_l2"] < r["bf16_output_rounding_rel_l2"] / 10
    assert r["fp8_hi_only_acc14_rel_l2"] > r["bf16_output_rounding_rel_l2"] * 5
