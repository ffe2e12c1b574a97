"""Routed MXFP4 GEMV kernels (ops/routed/routed_gemv.py) at tiny sizes: TRITON_INTERPRET=1 on CPU
(portable dequantisation), native on a GPU (table lookup). Against ops.common.reference_math and a float64 reference,
through run_experts (routed op and producer), with poisoned outputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from latent_moe_fusion.ops.routed import producer_config, routed_gemv
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from tests.expert_problems import EPS, bf16_vs_float64_tolerance, make_problem, rel_l2, tolerance
from tests.float64_reference import rms_norm64, routed64

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# K = 64 (L1) and 32 (L2): with 4-word steps L1 runs two K steps, L2 one.
SIZES = dict(latent=64, inter=32, num_experts=8, top_k=4, hidden=64, inter_s=32)


def _gemv_config(m: int, top_k: int) -> producer_config.ProducerConfig:
    base = producer_config.pick_config(m * top_k, "mxfp4", torch.bfloat16, SIZES["num_experts"])
    return replace(base, routed_gemv=True)


# Wide row tiles keep the interpreter's program count low; p < pairs makes programs walk several items; r64 caps
# the registers on a GPU (the interpreter ignores it).
@pytest.mark.parametrize("m,setting,routing", [(1, "16x32x4p2r64", "random"), (3, "8x16x4p1", "one_expert"),
                                               (2, "16x32x4p4", "few_experts"), (2, "32x64x4p2", "none")])
def test_gemv_routed_matches_reference_and_float64(m, setting, routing, tuned, rng_seed):
    tuned(routed_gemv=setting)
    p = make_problem(m, weight_format="mxfp4", routing=routing, device=DEVICE, **SIZES)
    out = torch.full_like(p.z, float("nan"))
    y = run_experts(*p.routed_args(), config=_gemv_config(m, p.topk_ids.shape[1]), out=out)
    assert y is out
    assert rel_l2(y, p.reference_routed()) < tolerance(torch.bfloat16)
    assert rel_l2(y, routed64(*p.routed_args())) < bf16_vs_float64_tolerance()


def test_gemv_producer_matches_float64(tuned, rng_seed):
    tuned(routed_gemv="16x32x4p2")
    p = make_problem(1, weight_format="mxfp4", device=DEVICE, **SIZES)
    s_out = torch.full_like(p.x_s, float("nan"))
    shared = SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out)
    y_n = run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=EPS, shared=shared,
                      config=_gemv_config(1, p.topk_ids.shape[1]))
    ref_y_n = rms_norm64(routed64(*p.routed_args()), p.rms_weight, EPS)
    assert rel_l2(y_n, ref_y_n) < bf16_vs_float64_tolerance()
    ref_y_n_math, ref_s = p.reference_producer()
    assert rel_l2(y_n, ref_y_n_math) < tolerance(torch.bfloat16)
    assert rel_l2(s_out, ref_s) < tolerance(torch.bfloat16)  # (float64 skips the bf16 rounding of its act)


def test_more_items_than_programs_visit_every_pair(tuned, rng_seed):
    """One program per row tile (p1) and every id valid: each program walks all pairs of its tile."""
    tuned(routed_gemv="32x64x4p1")
    p = make_problem(4, weight_format="mxfp4", routing="random", device=DEVICE, **SIZES)
    p.topk_ids = torch.stack([torch.randperm(SIZES["num_experts"])[: SIZES["top_k"]] for _ in range(4)]).int().to(DEVICE)
    y = run_experts(*p.routed_args(), config=_gemv_config(4, SIZES["top_k"]), out=torch.full_like(p.z, float("nan")))
    assert rel_l2(y, routed64(*p.routed_args())) < bf16_vs_float64_tolerance()


def test_a_given_gemv_config_that_cannot_run_says_why(tuned):
    tuned(routed_gemv="4x4x16")  # 16 words = 128 codes > K = 64
    p = make_problem(1, weight_format="mxfp4", device=DEVICE, **SIZES)
    with pytest.raises(ValueError, match="routed_gemv.*multiple of 128"):
        run_experts(*p.routed_args(), config=_gemv_config(1, SIZES["top_k"]))


def test_gemv_reasons():
    p = make_problem(1, weight_format="mxfp4", device="cpu", **SIZES)
    cfg = routed_gemv.RoutedGemvConfig(4, 4, 4, 1, 2)
    args = (p.z, p.w13, p.w2, p.w13_scale, p.w2_scale)
    assert routed_gemv.routed_gemv_reason(*args, "mxfp4", 4, cfg) is None
    assert "only MXFP4" in routed_gemv.routed_gemv_reason(*args, "bf16", 4, cfg)
    assert "pairs" in routed_gemv.routed_gemv_reason(*args, "mxfp4", routed_gemv.MAX_PAIRS + 1, cfg)
    assert "tiles of 64" in routed_gemv.routed_gemv_reason(*args, "mxfp4", 4, replace(cfg, l1_rows=64))
    strided = p.w13.transpose(1, 2).contiguous().transpose(1, 2)
    assert "contiguous" in routed_gemv.routed_gemv_reason(p.z, strided, p.w2, p.w13_scale, p.w2_scale, "mxfp4", 4, cfg)


@pytest.mark.parametrize("value,match", [("2", "expected 0, 1 or"), ("4x4", "expected 0, 1 or"),
                                         ("3x4x64", "power of two"), ("4x4x2", "words must be >= 4"),
                                         ("4x4x64w0", "power of two"), ("2x2x64r8", "max_registers must be in"),
                                         ("2x2x64r300", "max_registers must be in"), ("2x2x64rf", "expected 0, 1 or")])
def test_setting_rejects_bad_values(value, match, tuned):
    with pytest.raises(ValueError, match=f"{routed_gemv.ROUTED_GEMV_OVERRIDE}=.*{match}"):
        tuned(routed_gemv=value)


def test_setting_parses_a_full_spec(tuned):
    tuned(routed_gemv="8x2x32w2p4")
    assert routed_gemv.routed_gemv_setting() == (True, routed_gemv.RoutedGemvConfig(8, 2, 32, 2, 4))
    tuned(routed_gemv="4x4x64b")
    assert routed_gemv.routed_gemv_setting()[1] == routed_gemv.RoutedGemvConfig(4, 4, 64, 1, 2, scale_sums=False)
    tuned(routed_gemv="2x2x64w1p2fr80")
    assert routed_gemv.routed_gemv_setting()[1] == routed_gemv.RoutedGemvConfig(2, 2, 64, 1, 2, prefetch=True,
                                                                                  max_registers=80)
    tuned(routed_gemv="0")
    assert routed_gemv.routed_gemv_setting() == (False, routed_gemv.ROUTED_GEMV_CONFIG)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(producer_config, "_has_sm90", lambda: True)
    monkeypatch.setattr(producer_config, "_is_hopper", lambda: True)
    monkeypatch.setattr(producer_config, "interpreting", lambda: False)
def test_picked_for_up_to_four_top16_tokens_on_hopper(hopper, tuned):
    def picked(pairs, fmt="mxfp4"):
        return producer_config.pick_config(pairs, fmt, torch.bfloat16, 112).routed_gemv

    assert picked(16) and picked(routed_gemv.ROUTED_GEMV_MAX_PAIRS)
    assert not picked(routed_gemv.ROUTED_GEMV_MAX_PAIRS + 16)
    assert not picked(16, "bf16")
    tuned(routed_gemv="0")
    assert not picked(16)
    tuned(routed_gemv="1")
    assert picked(8 * 16)
    tuned(routed_gemv="4x4x64")
    assert picked(8 * 16)  # a spec forces the path too
    tuned(mxfp4_regs=False)
    assert not picked(16)  # beside the register-dequant kernels only (Hopper decode configs)
