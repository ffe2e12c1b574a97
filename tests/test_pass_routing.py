"""The router fusion (fusion_pass/routing.py): which router chains become lmf::noaux_tc_route, which are
left alone and why, and that fused and unfused compiles route every token to the same experts."""

import logging

import pytest
import torch
from torch import nn

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import FusionConfig
from latent_moe_fusion.model.router import localize_ids, route
from tests.fusion_models import block, compiled, post_grad, rel_l2

ROUTE_OP = "lmf.noaux_tc_route.default"
E, K = 64, 6


class Router(nn.Module):
    """route() on its own, optionally written with a twist the fusion must refuse or adapt to."""

    def __init__(self, twist: str = "", first: int = 0, num_local: int = E, scale: float = 1.0) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.randn(E, 32) * 0.5, requires_grad=False)
        self.bias = nn.Parameter(torch.randn(E) * 0.1, requires_grad=False)
        self.twist, self.first, self.num_local, self.scale = twist, first, num_local, scale

    def forward(self, x: torch.Tensor):
        t = self.twist
        if t in ("", "localize"):
            ids, w = route(x, self.gate, self.bias, K, self.scale)
            return (localize_ids(ids, self.first, self.num_local) if t == "localize" else ids), w
        logits = x.float() @ self.gate.float().t()
        scores = torch.softmax(logits, -1) if t == "softmax" else torch.sigmoid(logits)
        values, chosen = torch.topk(scores + self.bias, K, dim=-1, sorted=t == "sorted")
        w = scores.gather(-1, chosen)
        w = w / w.sum(-1, keepdim=True) if t == "no_eps" else w / (w.sum(-1, keepdim=True) + 1e-20)
        ids = chosen if t == "int64" else chosen.to(torch.int32)
        if t == "no_sub":  # the EP share of rank 0 as torch 2.14 leaves it: `ids - 0` dropped from the graph
            ids = torch.where((ids >= 0) & (ids < self.num_local), ids, torch.full_like(ids, -1))
        if t == "odd_fill":
            local = ids - self.first
            ids = torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -2))
        if t == "values_used":
            return ids, w, values
        if t == "scores_used":
            return ids, w, scores
        return ids, w


def _fused(model, x, config=None):
    fpass = lmf.LatentMoEFusionPass(config)
    post_grad(model, (x,), fpass)
    return fpass.report


def _same_routing(got, want):
    """Same experts per token with the same weights (CPU torch.topk orders the slots its own way)."""
    (ids, w), (want_ids, want_w) = got[:2], want[:2]
    order, want_order = (ids.double() * 100 + w).argsort(-1), (want_ids.double() * 100 + want_w).argsort(-1)
    assert torch.equal(ids.gather(-1, order), want_ids.gather(-1, want_order))
    torch.testing.assert_close(w.gather(-1, order), want_w.gather(-1, want_order), rtol=1e-6, atol=0)


@pytest.mark.parametrize("twist, first, num_local, scale, localized", [
    ("", 0, E, 1.0, False),
    ("", 0, E, 2.5, False),
    ("localize", 16, 16, 1.0, True),
    ("no_eps", 0, E, 1.0, False),
    ("odd_fill", 16, 16, 1.0, False),  # fill -2 is not localize_ids: the op's ids feed Inductor's where
    ("no_sub", 0, 16, 1.0, True),  # first = 0 with the subtraction folded away: still the EP share
])
def test_router_chain_is_fused_and_routes_alike(rng_seed, twist, first, num_local, scale, localized):
    model = Router(twist, first, num_local, scale)
    x = torch.randn(9, 32)
    fpass = lmf.LatentMoEFusionPass()
    got = compiled(model, fpass)(x)
    want = compiled(model, None)(x)
    report = fpass.report
    assert [r.localized for r in report.routings] == [localized], report.summary()
    assert report.ops_after[ROUTE_OP] == 1 and report.ops_after["aten.topk.default"] == 0
    assert report.routing_rejected == []
    assert (report.routings[0].share_reason is not None) == (twist == "odd_fill"), report.summary()
    _same_routing(got, want)
    assert "lmf::noaux_tc_route top_k=6" in report.summary()


@pytest.mark.parametrize("twist, reason", [
    ("sorted", "sorted=True"),
    ("softmax", "is not sigmoid(logits) + bias"),
    ("int64", "not converted to int32"),
    ("values_used", "topk's values are used"),
    ("scores_used", "router scores (sigmoid) is also used by output"),
])
def test_other_routers_are_left_alone_with_a_reason(twist, reason, caplog):
    with caplog.at_level(logging.INFO, logger="latent_moe_fusion"):
        report = _fused(Router(twist), torch.randn(4, 32))
    # every aten.topk is examined; one that is no router must not warn (logged at INFO with its reason)
    logged = [r for r in caplog.records if r.name == "latent_moe_fusion"]
    assert logged and all(r.levelno == logging.INFO for r in logged) and reason in logged[0].getMessage()
    assert report.routings == []
    assert len(report.routing_rejected) == 1 and reason in report.routing_rejected[0][1], report.routing_rejected
    assert report.ops_after["aten.topk.default"] == 1


def test_bf16_logits_are_left_alone():
    class Bf16Router(Router):
        def forward(self, x):
            scores = torch.sigmoid(x @ self.gate.t())
            chosen = torch.topk(scores + self.bias.bfloat16(), K, sorted=False).indices
            return chosen.to(torch.int32), scores.gather(-1, chosen)

    report = _fused(Bf16Router().bfloat16(), torch.randn(4, 32, dtype=torch.bfloat16))
    assert report.routings == [] and "not a 2-D float32" in report.routing_rejected[0][1]


def test_switches(monkeypatch):
    x = torch.randn(4, 32)
    off = FusionConfig(fuse_routing=False)
    report = _fused(Router(), x, off)
    assert report.routings == [] and report.routing_rejected == [] and report.ops_after["aten.topk.default"] == 1
    assert lmf.LatentMoEFusionPass(off).uuid() != lmf.LatentMoEFusionPass().uuid()
    monkeypatch.setenv("LMF_DISABLE_FUSION", "1")
    report = _fused(Router(), x)
    assert report.routings == [] and "switched off" in report.routing_rejected[0][1]


@pytest.mark.parametrize("dtype, ep_size", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_block_router_and_block_are_both_fused(rng_seed, dtype, ep_size):
    model = block(seed=rng_seed % 1000, dtype=dtype, ep_size=ep_size, ep_rank=ep_size - 1)
    x = torch.randn(6, model.cfg.hidden_size, dtype=dtype)
    fpass = lmf.LatentMoEFusionPass()
    out = compiled(model, fpass)(x)
    report = fpass.report
    assert report.matched == 1 and [r.localized for r in report.routings] == [ep_size > 1], report.summary()
    assert report.ops_after["aten.topk.default"] == 0 and report.ops_after["lmf.routed_experts.default"] == 0
    ref = model(x)
    assert rel_l2(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_dynamic_batch_size(rng_seed):
    """A symbolic M: the op's fake impl and the finder take it; every size routes like the eager chain."""
    model = Router("localize", 16, 16)
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(model, options={"post_grad_custom_pre_pass": fpass}, dynamic=True)
        for tokens in (3, 7, 11):
            x = torch.randn(tokens, 32)
            _same_routing(fn(x), model(x))
    assert [r.localized for r in fpass.report.routings] == [True], fpass.report.summary()
