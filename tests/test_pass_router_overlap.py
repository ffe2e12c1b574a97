"""The router beside the down-projection (fusion_pass/router_overlap.py): which fused routers go into
lmf::route_and_project with their gate GEMM and the latent down-projection, or with the fused block's
producer too into lmf::route_and_produce, which stay alone and why, and that the rewrite changes no bit
of the block's output."""

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import ChainedGraphPass, FusionConfig
from latent_moe_fusion.model.router import route_from_logits
from tests.fusion_models import CFG, Stop, block, compiled, post_grad, rel_l2
from tests.test_pass_routing import Router

ROUTE_AND_PROJECT = "lmf.route_and_project.default"
ROUTE_AND_PRODUCE = "lmf.route_and_produce.default"
PRODUCER = "lmf.moe_shared_producer.default"
BF16 = torch.bfloat16


def _x(m: int, dtype=BF16) -> torch.Tensor:
    return torch.randn(m, CFG.hidden_size, dtype=dtype)


class Capture(CustomGraphPass):
    """Keeps the args of the lmf::route_and_project / lmf::route_and_produce nodes the pass before it left."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, graph) -> None:
        self.calls = [n.args for n in graph.nodes
                      if n.op == "call_function" and str(n.target) in (ROUTE_AND_PROJECT, ROUTE_AND_PRODUCE)]

    def uuid(self) -> None:
        return None


def _fused_graph(model, x, config=None):
    fpass, capture = lmf.LatentMoEFusionPass(config), Capture()
    post_grad(model, (x,), ChainedGraphPass(fpass, capture, Stop()))
    return fpass.report, capture.calls


@pytest.mark.parametrize("shared_first", [True, False])
def test_block_router_goes_beside_the_down_projection_without_changing_a_bit(rng_seed, shared_first):
    model = block(seed=rng_seed % 1000, dtype=BF16, ep_size=2, ep_rank=1, weight_format="mxfp4")
    x = _x(5)
    beside = lmf.LatentMoEFusionPass(FusionConfig(shared_first=shared_first))
    alone = lmf.LatentMoEFusionPass(FusionConfig(overlap_router=False))
    out = compiled(model, beside)(x)
    out_alone = compiled(model, alone)(x)
    report = beside.report
    assert report.matched == 1 and len(report.routings) == 1, report.summary()
    routing = report.routings[0]
    assert routing.beside is not None and routing.beside_reason is None and routing.with_producer == shared_first
    op = "lmf::route_and_produce" if shared_first else "lmf::route_and_project"
    assert op in report.summary(), report.summary()
    assert report.ops_after[ROUTE_AND_PRODUCE] == shared_first and report.ops_after[ROUTE_AND_PROJECT] == (not shared_first)
    assert report.ops_after[PRODUCER] == (not shared_first) and report.ops_after["lmf.noaux_tc_route.default"] == 0
    assert alone.report.ops_after["aten.mm.default"] - report.ops_after["aten.mm.default"] == 2
    assert alone.report.routings[0].beside is None and alone.report.routings[0].beside_reason is None
    assert torch.equal(out, out_alone)  # the same calls, in another place
    assert rel_l2(out, model(x)) < 1e-2


def test_routed_op_alone_goes_into_route_and_project(rng_seed):
    """No fused block (its producer), only lmf::routed_experts: the router and the down-projection go beside."""
    model = TwistedRouterBlock("plain_routed", dtype=BF16)
    x = _x(4)
    report, calls = _fused_graph(model, x, FusionConfig(forms=("all_reduce",)))  # the local block is not fused
    assert report.matched == 0 and len(calls) == 1 and len(calls[0]) == 10, report.summary()
    assert report.routings[0].beside is not None and not report.routings[0].with_producer


def test_fp32_block_and_its_router_form(rng_seed):
    model = block(seed=rng_seed % 1000, dtype=torch.float32)
    report, calls = _fused_graph(model, _x(3, torch.float32))
    assert report.routings[0].beside is not None, report.summary()
    assert len(calls) == 1 and calls[0][4] == "fp32"  # router_gemm


class OutDtypeRouterBlock(lmf.KimiK3MoEBlock):
    """The BF16 router GEMM with an FP32 output (router_gemm='bf16' on CUDA), traced on the CPU."""

    def routed(self, x):
        logits = torch.mm(x, self.gate_weight.t(), out_dtype=torch.float32)
        ids, weights = route_from_logits(logits, self.correction_bias, self.cfg.top_k, self.cfg.routed_scaling_factor)
        z = F.linear(x, self.w_down)
        return torch.ops.lmf.routed_experts(z, ids, weights, self.w13, self.w2, self.w13_scale, self.w2_scale,
                                            self.weight_format, self.cfg.situ_beta, self.cfg.situ_linear_beta)


def test_out_dtype_router_gemm_is_taken_as_the_bf16_form():
    model = OutDtypeRouterBlock(CFG, dtype=BF16)
    report, calls = _fused_graph(model, _x(4))
    assert report.matched == 1 and report.routings[0].beside is not None, report.summary()
    assert len(calls) == 1 and calls[0][4] == "bf16"
    assert all(a.op == "placeholder" for a in calls[0][:4])  # x, gate_weight, correction_bias, w_down


class TwistedRouterBlock(lmf.KimiK3MoEBlock):
    """twist "logits_out": the router's logits are also an output; "other_tokens": z is not of x;
    "plain_routed": the reference block."""

    def __init__(self, twist: str, **kwargs) -> None:
        super().__init__(CFG, **kwargs)
        self.twist = twist

    def forward(self, x):
        if self.twist == "plain_routed":
            return super().forward(x)
        logits = F.linear(x.float(), self.gate_weight.float())
        ids, weights = route_from_logits(logits, self.correction_bias, self.cfg.top_k, self.cfg.routed_scaling_factor)
        z = F.linear(x * 2 if self.twist == "other_tokens" else x, self.w_down)
        y = torch.ops.lmf.routed_experts(z, ids, weights, self.w13, self.w2, self.w13_scale, self.w2_scale,
                                         self.weight_format, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        out = F.linear(F.rms_norm(y, (y.shape[-1],), self.norm_weight, self.cfg.rms_norm_eps), self.w_up) + self.shared(x)
        return (out, logits) if self.twist == "logits_out" else out


def test_routers_left_alone_say_why():
    cases = [
        (Router(), torch.randn(4, 32), "feed 0 routed-expert ops"),
        (TwistedRouterBlock("other_tokens", dtype=BF16), _x(4), "is not x @ W_down^T of the router's tokens"),
        (TwistedRouterBlock("logits_out", dtype=BF16), _x(4), "are also used by output"),
    ]
    for model, x, reason in cases:
        report, calls = _fused_graph(model, x)
        assert len(report.routings) == 1 and calls == [], report.summary()
        r = report.routings[0]
        assert r.beside is None and reason in r.beside_reason, r.beside_reason
        assert reason in report.summary()


def test_switch_is_part_of_the_cache_key():
    on, off = lmf.LatentMoEFusionPass(), lmf.LatentMoEFusionPass(FusionConfig(overlap_router=False))
    assert on.uuid() != off.uuid()
    assert "router/beside_down_projection" in on.config.pattern_set()
    assert "router/beside_down_projection" not in off.config.pattern_set()
    assert "router/beside_down_projection" not in FusionConfig(fuse_routing=False).pattern_set()
    first, not_first = lmf.LatentMoEFusionPass(), lmf.LatentMoEFusionPass(FusionConfig(shared_first=False))
    assert first.uuid() != not_first.uuid()
    assert "router/with_producer" in first.config.pattern_set()
    assert "router/with_producer" not in not_first.config.pattern_set()
    assert "router/with_producer" not in FusionConfig(overlap_router=False).pattern_set()


def test_static_prefill_sizes_stay_in_a_row():
    from latent_moe_fusion.ops.routed.router_fused.route_and_produce import SHARED_FIRST_MAX_TOKENS
    from latent_moe_fusion.ops.routed.router_fused.route_and_project import OVERLAP_MAX_TOKENS

    not_first = FusionConfig(shared_first=False)
    for m, config, limit in ((OVERLAP_MAX_TOKENS + 1, not_first, OVERLAP_MAX_TOKENS),
                             (SHARED_FIRST_MAX_TOKENS + 1, None, SHARED_FIRST_MAX_TOKENS)):
        report, calls = _fused_graph(block(dtype=BF16), _x(m), config)
        assert report.matched == 1 and calls == [], report.summary()
        assert f"> {limit}: side by side only pays at decode sizes" in report.routings[0].beside_reason
    report, calls = _fused_graph(block(dtype=BF16), _x(OVERLAP_MAX_TOKENS), not_first)
    assert len(calls) == 1 and not report.routings[0].with_producer, report.summary()
    report, calls = _fused_graph(block(dtype=BF16), _x(SHARED_FIRST_MAX_TOKENS))
    assert len(calls) == 1 and report.routings[0].with_producer, report.summary()


def test_dynamic_batch_keeps_the_op_and_routes_every_size(rng_seed):
    """A symbolic M: the pass cannot tell decode from prefill, so the op goes in and decides per call."""
    model = block(seed=rng_seed % 1000, dtype=torch.float32, ep_size=2, ep_rank=0)
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch({"fx_graph_cache": False, "compile_threads": 1}):
        fn = torch.compile(model, options={"post_grad_custom_pre_pass": fpass}, dynamic=True)
        for m in (3, 70):
            x = _x(m, torch.float32)
            out = fn(x)
            assert rel_l2(out, model(x)) < 1e-5, m
    assert fpass.report.routings and fpass.report.routings[0].beside is not None, fpass.report.summary()
    # dynamic=True also makes the routed scaling factor a symbolic float, a graph input: the weights reach the
    # producer through a multiply by it, so the producer stays out of the op (a marked batch dimension, below,
    # keeps the float and takes it)
    assert fpass.report.ops_after[ROUTE_AND_PROJECT] + fpass.report.ops_after[ROUTE_AND_PRODUCE] == 1


def test_marked_dynamic_batch_takes_the_producer(rng_seed):
    """A symbolic M the way serving engines compile (the batch dimension marked dynamic, floats kept): the
    producer goes into lmf::route_and_produce, which decides per call, and every size matches eager."""
    model = block(seed=rng_seed % 1000, dtype=torch.float32, ep_size=2, ep_rank=0)
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    with torch._inductor.config.patch({"fx_graph_cache": False, "compile_threads": 1}):
        fn = torch.compile(model, options={"post_grad_custom_pre_pass": fpass})
        for m in (3, 70, 200):
            x = _x(m, torch.float32)
            torch._dynamo.mark_dynamic(x, 0)
            assert rel_l2(fn(x), model(x)) < 1e-5, m
    assert len(fpass.report.routings) == 1 and fpass.report.routings[0].with_producer, fpass.report.summary()
    assert fpass.report.ops_after[ROUTE_AND_PRODUCE] == 1 and fpass.report.ops_after[ROUTE_AND_PROJECT] == 0
