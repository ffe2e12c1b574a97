"""lmf::routed_experts on DeepGEMM's SM90 grouped GEMMs: argument mapping on the CPU (fake deep_gemm)
and, on an H200 with DeepGEMM installed, against the reference op."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common.backends import select_backend
from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4
from latent_moe_fusion.ops.common.reference_math import routed_experts_math
from latent_moe_fusion.ops.routed import deepgemm
from latent_moe_fusion.ops.routed.deepgemm import sm90_grouped
from latent_moe_fusion.ops.routed.deepgemm.probe import SM90_GROUPED, probe_deepgemm
from tests.deepgemm_fake import FakeDeepGemm, install

# DeepGEMM's grouped GEMMs round h and each expert's output to BF16 (the contract keeps FP32):
# one extra BF16 rounding, so a looser bound than the Triton backend's.
TOL = 1.5e-2


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())


def make_args(m, e, latent, inter, k, weight_format, device="cpu", dup=True):
    z = torch.randn(m, latent, device=device).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e + 3)[:k] - 3 for _ in range(m)]).clamp_min(-1).to(torch.int32)
    if dup and m > 1:
        ids[1, 1] = ids[1, 0] = max(int(ids[1, 0]), 0)  # the contract allows a repeated id: both slots count
    ids = ids.to(device)
    w = torch.rand(m, k, device=device)
    w13 = torch.randn(e, 2 * inter, latent, device=device) * latent**-0.5
    w2 = torch.randn(e, latent, inter, device=device) * inter**-0.5
    if weight_format == "bf16":
        return (z, ids, w, w13.to(torch.bfloat16), w2.to(torch.bfloat16), None, None, "bf16", 4.0, 25.0)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return (z, ids, w, q13, q2, s13, s2, "mxfp4", 4.0, 25.0)


@pytest.fixture
def fake(monkeypatch):
    f = FakeDeepGemm(mk_alignment=32)
    install(monkeypatch, f, (9, 0))
    monkeypatch.setenv("LMF_BACKEND_ROUTED_EXPERTS", "deepgemm")
    yield f
    deepgemm.reset_deepgemm_state()


def test_routing_plan_merges_duplicates_and_drops_negatives():
    ids = torch.tensor([[2, 2, -1], [0, 2, 1], [-1, -1, -1]], dtype=torch.int32)
    w = torch.tensor([[0.25, 0.5, 9.0], [1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    plan = sm90_grouped.plan_routing(ids, w, num_experts=3)
    assert plan.keep.tolist() == [[True, False, False], [True, True, True], [False, False, False]]
    assert plan.weight[0, 0] == 0.75 and plan.counts.tolist() == [1, 1, 2]
    assert plan.pos[0, 0] == 0 and plan.pos[1, 1] == 1  # token 1 is expert 2's second token


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_mapping_against_fake(fake, tuned, layout, weight_format):
    tuned(deepgemm_routed_layout=layout)
    args = make_args(m=7, e=6, latent=64, inter=64, k=4, weight_format=weight_format)
    assert select_backend("routed_experts", "cuda", *args).name == "deepgemm"
    out = sm90_grouped.routed_deepgemm(*args)
    assert out.dtype == torch.bfloat16 and out.shape == args[0].shape and torch.isfinite(out).all()
    assert rel_l2(out, routed_experts_math(*args)) < TOL
    name = f"m_grouped_bf16_gemm_nt_{layout}"
    assert fake.count(name) == 2  # L1 and L2
    if layout == "masked":
        ids = args[1]
        expected = [int(((ids == e).sum(dim=1) > 0).sum()) for e in range(6)]  # tokens per expert, deduped
        assert [c[1]["masked_m"].tolist() for c in fake.calls if c[0] == name][0] == expected
    # MXFP4 weights are dequantized to BF16 once, not per call
    sm90_grouped.routed_deepgemm(*args)
    assert len(sm90_grouped._BF16_COPIES) == (1 if weight_format == "mxfp4" else 0)


def test_opt_in_and_dtype_reasons(fake, monkeypatch):
    args = make_args(m=3, e=4, latent=64, inter=64, k=2, weight_format="bf16")
    monkeypatch.delenv("LMF_BACKEND_ROUTED_EXPERTS")
    assert "opt-in" in sm90_grouped.supports(*args)
    monkeypatch.setenv("LMF_BACKEND", "deepgemm")
    assert sm90_grouped.supports(*args) is None
    f32 = (args[0].float(), *args[1:3], args[3].float(), args[4].float(), *args[5:])
    assert "bfloat16" in sm90_grouped.supports(*f32)
    odd = make_args(m=3, e=4, latent=96, inter=64, k=2, weight_format="bf16")
    assert "K % 64" in sm90_grouped.supports(*odd)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 128, 512])
@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_sm90_routed_against_reference_op(monkeypatch, m, weight_format):
    deepgemm.reset_deepgemm_state()
    if not probe_deepgemm().has(SM90_GROUPED):
        pytest.skip(f"DeepGEMM SM90 grouped GEMMs unavailable: {probe_deepgemm().reason}")
    monkeypatch.setenv("LMF_BACKEND_ROUTED_EXPERTS", "deepgemm")
    torch.manual_seed(m)
    args = make_args(m=m, e=16, latent=512, inter=256, k=8, weight_format=weight_format, device="cuda")
    assert select_backend("routed_experts", "cuda", *args).name == "deepgemm"
    out = torch.ops.lmf.routed_experts(*args)
    monkeypatch.setenv("LMF_BACKEND_ROUTED_EXPERTS", "reference")
    ref = torch.ops.lmf.routed_experts(*args)
    assert torch.isfinite(out).all() and rel_l2(out, ref) < TOL


def test_layout_switch_refuses_other_words(tuned):
    with pytest.raises(ValueError, match=f"{sm90_grouped.LAYOUT_OVERRIDE}='maskd': expected one of masked, contiguous"):
        tuned(deepgemm_routed_layout="maskd")
    assert sm90_grouped.choose_layout(8) == "masked" and sm90_grouped.choose_layout(4096) == "contiguous"
