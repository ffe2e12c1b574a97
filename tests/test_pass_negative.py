"""Negative tests: blocks the pass must leave alone, graph unchanged, every candidate given a reason."""

import logging

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import ChainedGraphPass, FusionConfig
from latent_moe_fusion.ops.common import backends
from latent_moe_fusion.ops.common.backends import Backend, register_backend
from latent_moe_fusion.ops.routed.expert_reference import producer_reference
from latent_moe_fusion.ops.tail.tail_reference import tail_reference
from tests.fusion_models import (
    CFG,
    PRODUCER,
    HalfTailBlock,
    LeakyBlock,
    OtherBetaBlock,
    Side,
    TransposedUpBlock,
    block,
    fake_group,
    post_grad,
    unchanged,
)

BF16 = torch.bfloat16


def _reasons(report) -> list[str]:
    return [reason for _, reason in report.rejected]


def test_blocks_with_escaping_intermediates_or_mixed_dtypes_are_left_alone(caplog):
    models = [
        LeakyBlock("shared", dtype=BF16),
        LeakyBlock("routed", dtype=BF16),
        LeakyBlock("normed", dtype=BF16, rms_norm="manual"),
        LeakyBlock("up", dtype=BF16, shared_gate_up="split"),
        HalfTailBlock(CFG, dtype=BF16),
        OtherBetaBlock(CFG, dtype=BF16),
        TransposedUpBlock(dtype=BF16),
    ]
    fusion_pass = lmf.LatentMoEFusionPass()
    with caplog.at_level(logging.INFO, logger="latent_moe_fusion"):
        post_grad(Side(models), (torch.randn(8, CFG.hidden_size, dtype=BF16),), fusion_pass)
    report = fusion_pass.report
    assert unchanged(report), report.summary()
    assert report.ops_after[PRODUCER] == 0
    reasons = _reasons(report)
    assert len(reasons) == len(models), report.summary()
    expected = [
        "shared expert output (",  # ... also used by output
        "routed-expert output y (",  # ... is also a graph output
        "RMSNorm intermediate",  # ... is also a graph output
        "routed up-projection output u",  # ... is used by add, output
        "float16 while the routed path is bfloat16",
        "no registered pattern matched",
        "the fused ops refuse the matched arguments (LmfInputError: lmf::latent_tail: w_up must be contiguous",
    ]
    for want in expected:
        assert sum(want in r for r in reasons) == 1, report.summary()
    assert any("also used by output" in r for r in reasons), reasons
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "latent_moe_fusion"]
    routers = [m for m in logged if "the router" in m]  # each block's router chain is fused on its own
    assert len(routers) == len(models) and all(m.startswith("latent_moe_fusion: fused the router") for m in routers)
    logged = [m for m in logged if m not in routers]
    assert len(logged) == len(models) and all("left" in m and "unfused" in m for m in logged), logged


def _narrow_tail_backends(monkeypatch) -> None:
    """A producer backend that takes anything and a tail backend that refuses this hidden size (CPU)."""
    for op in ("moe_shared_producer", "latent_tail"):
        monkeypatch.setitem(backends._REGISTRY, op, backends.backends_for(op))
    register_backend(Backend("moe_shared_producer", "test-any", 0, ("cpu",), producer_reference))
    register_backend(Backend("latent_tail", "test-narrow", 0, ("cpu",), tail_reference,
                             supports=lambda y_n, w_up, *rest: f"hidden {w_up.shape[0]} unsupported by the test tail"))


def test_switch_configuration_and_backends_reject_with_reasons(monkeypatch):
    """One trace, several passes chained on the same (never rewritten) graph, each with its own reason."""
    x = torch.randn(8, CFG.hidden_size, dtype=BF16)
    _narrow_tail_backends(monkeypatch)
    with fake_group(2) as group:
        model = Side([block(1, dtype=BF16), block(2, dtype=BF16, tp_group=group)])
        monkeypatch.setenv("LMF_DISABLE_FUSION", "1")
        disabled = lmf.LatentMoEFusionPass()
        monkeypatch.delenv("LMF_DISABLE_FUSION")
        passes = {
            "LMF_DISABLE_FUSION=1": disabled,
            "activation dtype bfloat16 is not supported": lmf.LatentMoEFusionPass(FusionConfig(dtypes=("float32",))),
            f"no backend of lmf::latent_tail serves this block on cpu (test-narrow: hidden {CFG.hidden_size} "
            "unsupported by the test tail;":
                lmf.LatentMoEFusionPass(FusionConfig(reference_backend_devices=())),
            "is not enabled (FusionConfig.forms": lmf.LatentMoEFusionPass(FusionConfig(forms=("sequence_parallel",))),
        }
        post_grad(model, (x,), ChainedGraphPass(*passes.values()))
    assert not disabled.enabled
    for want, fusion_pass in passes.items():
        report = fusion_pass.report
        assert unchanged(report), report.summary()
        assert len(report.rejected) == 2 and all(want in r for r in _reasons(report)), (want, report.summary())
    narrow = _reasons(passes[next(k for k in passes if "test-narrow" in k)].report)
    assert all("reference: not used for fusion on cpu" in r for r in narrow), narrow
    forms = _reasons(passes["is not enabled (FusionConfig.forms"].report)
    assert "'local'" in forms[0] and "'all_reduce'" in forms[1]


@pytest.mark.parametrize("value", ["1", "true"])
def test_disable_switch_values(monkeypatch, value):
    monkeypatch.setenv("LMF_DISABLE_FUSION", value)
    assert not lmf.LatentMoEFusionPass().enabled
    monkeypatch.setenv("LMF_DISABLE_FUSION", "0")
    assert lmf.LatentMoEFusionPass().enabled


@pytest.mark.parametrize("field, value", [("forms", ("tp",)), ("dtypes", ("float16",)), ("norm_forms", ["manual"])])
def test_fusion_config_rejects_unknown_values(field, value):
    with pytest.raises(ValueError, match=f"FusionConfig.{field}"):
        FusionConfig(**{field: value})
