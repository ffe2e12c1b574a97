"""The SP block's token all-gather into lmf::route_gather_and_produce (fusion_pass/router_overlap.py): where x_s is
wait_tensor(all_gather_into_tensor(x, R, group)) of the router's tokens, over the block's R and group, read by the
shared expert alone, every argument at its default, the gather goes into the op; anything else keeps
lmf::route_and_produce with the gather before it, and the report says why. Traced on a single-process fake group
(the numerics run on gloo ranks: tests/test_token_gather_gloo.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import ChainedGraphPass, FusionConfig
from latent_moe_fusion.model.layers import RMS_NORMS
from latent_moe_fusion.ops.common import backends
from latent_moe_fusion.ops.common.backends import Backend, register_backend
from tests.fusion_models import ALL_GATHER, CFG, ROUTE_AND_PRODUCE, ROUTE_GATHER_AND_PRODUCE, fake_group, post_grad

BF16 = torch.bfloat16
c10d = torch.ops._c10d_functional
GATHER_TARGET = c10d.all_gather_into_tensor.default
WAIT_TARGET = c10d.wait_tensor.default


class TwistedGatherBlock(lmf.KimiK3MoEBlock):
    """The SP reference block written out, with one twist in its token gather: "none" (as the reference block),
    "leak" (the gathered tokens are also an output), "other_group" (gathered over another group of the same ranks),
    "other_tokens" (gathers a second input, not the tokens it routes)."""

    def __init__(self, twist: str, group: dist.ProcessGroup, **kwargs) -> None:
        super().__init__(CFG, tp_group=group, sequence_parallel=True, **kwargs)
        self.twist = twist
        self.gather_group = dist.new_group(list(range(self.tp_world))).group_name if twist == "other_group" else None

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None):
        y_n = RMS_NORMS[self.rms_norm_form](self.routed(x), self.norm_weight, self.cfg.rms_norm_eps)
        u = F.linear(y_n, self.w_up)
        tokens = other if self.twist == "other_tokens" else x
        x_s = c10d.wait_tensor(c10d.all_gather_into_tensor(tokens, self.tp_world, self.gather_group or self.group_name))
        s = c10d.wait_tensor(c10d.reduce_scatter_tensor(self.shared(x_s), "sum", self.tp_world, self.group_name))
        return (u + s, x_s) if self.twist == "leak" else u + s


class Edit(CustomGraphPass):
    """Changes the token gather of the graph before the fusion pass sees it (graphs no consistent block traces to)."""

    def __init__(self, change: Callable[[fx.Node, fx.Node], None]) -> None:
        self.change = change

    def __call__(self, graph: fx.Graph) -> None:
        gathers = [n for n in graph.nodes if n.op == "call_function" and n.target is GATHER_TARGET]
        assert len(gathers) == 1, graph
        self.change(gathers[0], next(iter(gathers[0].users)))

    def uuid(self) -> None:
        return None


class Capture(CustomGraphPass):
    """The args of the gathering op's nodes the passes before it left."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, graph: fx.Graph) -> None:
        self.calls = [n.args for n in graph.nodes if n.op == "call_function" and str(n.target) == ROUTE_GATHER_AND_PRODUCE]

    def uuid(self) -> None:
        return None


def _x(m: int = 8) -> torch.Tensor:
    return torch.randn(m, CFG.hidden_size, dtype=BF16)


def _fuse(model, args: tuple, config: FusionConfig | None = None, edit: Edit | None = None):
    fpass, capture = lmf.LatentMoEFusionPass(config), Capture()
    post_grad(model, args, ChainedGraphPass(*([edit] if edit else []), fpass, capture))
    return fpass.report, capture.calls


def _gathered_inside(report) -> None:
    assert report.matched == 1 and len(report.routings) == 1, report.summary()
    routing = report.routings[0]
    assert routing.with_producer and routing.gathers_tokens and routing.gather_reason is None, report.summary()
    assert report.ops_after[ROUTE_GATHER_AND_PRODUCE] == 1 and report.ops_after[ROUTE_AND_PRODUCE] == 0
    assert report.ops_after[ALL_GATHER] == report.ops_after["_c10d_functional.wait_tensor.default"] == 0
    assert "lmf::route_gather_and_produce" in report.summary()


def _gathered_before(report, reason: str) -> None:
    """Today's rewrite: the block and its router into lmf::route_and_produce, the gather left before it."""
    assert report.matched == 1 and len(report.routings) == 1, report.summary()
    routing = report.routings[0]
    assert routing.with_producer and not routing.gathers_tokens, report.summary()
    assert reason in (routing.gather_reason or ""), routing.gather_reason
    assert f"the SP tokens gathered before the op: {routing.gather_reason}" in report.summary()
    assert report.ops_after[ROUTE_AND_PRODUCE] == 1 and report.ops_after[ROUTE_GATHER_AND_PRODUCE] == 0
    assert report.ops_after[ALL_GATHER] == 1


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gate_up, weight_format", [("merged", "bf16"), ("split", "mxfp4")])
def test_the_reference_sp_block_gathers_inside_the_op(world, gate_up, weight_format):
    with fake_group(world) as group:
        model = lmf.KimiK3MoEBlock(CFG, tp_group=group, sequence_parallel=True, dtype=BF16, shared_gate_up=gate_up,
                                   weight_format=weight_format)
        report, calls = _fuse(model, (_x(),))
        _gathered_inside(report)
        (args,) = calls
        assert len(args) == 24 and args[19] == world and args[23] == group.group_name  # group_size, group_name
        assert args[0].op == "placeholder"  # this rank's tokens, not a gather


def test_the_written_out_block_is_taken_like_the_reference():
    with fake_group(2) as group:
        report, _ = _fuse(TwistedGatherBlock("none", group, dtype=BF16), (_x(),))
    _gathered_inside(report)


def test_a_gather_written_with_keywords_is_taken_too():
    def as_keywords(gather: fx.Node, wait: fx.Node) -> None:
        gather.kwargs = dict(zip(("input", "group_size", "group_name"), gather.args, strict=True))
        gather.args = ()

    with fake_group(2) as group:
        model = lmf.KimiK3MoEBlock(CFG, tp_group=group, sequence_parallel=True, dtype=BF16)
        report, calls = _fuse(model, (_x(),), edit=Edit(as_keywords))
    _gathered_inside(report)
    assert calls[0][19] == 2


def test_prefill_sizes_take_the_gathering_op():
    """No size bound: the gather it hides grows with the tokens (lmf::route_and_produce alone stops at 128)."""
    from latent_moe_fusion.ops.routed.router_fused.route_and_produce import SHARED_FIRST_MAX_TOKENS

    m = SHARED_FIRST_MAX_TOKENS + 72
    with fake_group(2) as group:
        model = lmf.KimiK3MoEBlock(CFG, tp_group=group, sequence_parallel=True, dtype=BF16)
        report, _ = _fuse(model, (_x(m),))
        _gathered_inside(report)
        off, _ = _fuse(model, (_x(m),), FusionConfig(gather_tokens=False))
    assert off.ops_after[ROUTE_AND_PRODUCE] == off.ops_after[ROUTE_GATHER_AND_PRODUCE] == 0
    assert f"M = {m} tokens > {SHARED_FIRST_MAX_TOKENS}" in off.routings[0].beside_reason, off.summary()


def test_switched_off_keeps_the_gather_before_route_and_produce_and_says_so():
    with fake_group(2) as group:
        model = lmf.KimiK3MoEBlock(CFG, tp_group=group, sequence_parallel=True, dtype=BF16)
        report, _ = _fuse(model, (_x(),), FusionConfig(gather_tokens=False))
    _gathered_before(report, "FusionConfig.gather_tokens is off")


def test_tp_block_has_no_gather_to_take():
    with fake_group(2) as group:
        report, _ = _fuse(lmf.KimiK3MoEBlock(CFG, tp_group=group, dtype=BF16), (_x(),))
    routing = report.routings[0]
    assert routing.with_producer and not routing.gathers_tokens and routing.gather_reason is None, report.summary()


@pytest.mark.parametrize("twist, reason", [
    ("leak", "the gathered tokens wait_tensor also used by output; the op does not return them"),
    ("other_group", "gathers over group '1', the block's reduce-scatter over '0'"),
    ("other_tokens", "all_gather_into_tensor gathers arg"),
])
def test_blocks_whose_gather_the_op_cannot_take_keep_todays_rewrite(twist, reason):
    with fake_group(2) as group:
        model = TwistedGatherBlock(twist, group, dtype=BF16)
        args = (_x(), _x()) if twist == "other_tokens" else (_x(),)
        report, _ = _fuse(model, args)
    _gathered_before(report, reason)
    if twist == "other_tokens":
        assert "not the tokens" in report.routings[0].gather_reason


def _set_args(args: tuple, kwargs: dict | None = None) -> Callable[[fx.Node, fx.Node], None]:
    def change(gather: fx.Node, wait: fx.Node) -> None:
        gather.args = args(gather) if callable(args) else args
        if kwargs is not None:
            gather.kwargs = kwargs

    return change


def _wait_kwargs(gather: fx.Node, wait: fx.Node) -> None:
    wait.kwargs = {"extra": 1}


@pytest.mark.parametrize("change, reason", [
    # another R over the same group (the fake values stay those of R = 2: only the argument differs)
    (_set_args(lambda g: (g.args[0], 4, g.args[2])), "all_gather_into_tensor gathers from 4 ranks, the block's "
                                                     "reduce-scatter from 2"),
    # arguments the walk does not read: an extra positional, a keyword, and one on the wait
    (_set_args(lambda g: (*g.args, "extra")), "the SP tokens' all-gather: all_gather_into_tensor "
                                              "(_c10d_functional.all_gather_into_tensor.default) has argument 3='extra', "
                                              "which the fused op does not compute"),
    (_set_args(lambda g: g.args, {"tag": "t"}), "all_gather_into_tensor.default) has tag='t', which the fused op"),
    (_wait_kwargs, "the SP tokens' all-gather: wait_tensor (_c10d_functional.wait_tensor.default) has extra=1"),
], ids=["other_R", "extra_positional", "extra_keyword", "wait_keyword"])
def test_gathers_with_another_r_or_stray_arguments_keep_todays_rewrite(change, reason):
    with fake_group(2) as group:
        model = lmf.KimiK3MoEBlock(CFG, tp_group=group, sequence_parallel=True, dtype=BF16)
        report, _ = _fuse(model, (_x(),), edit=Edit(change))
    _gathered_before(report, reason)


def test_a_refusing_gathering_op_falls_back_to_route_and_produce(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, "route_gather_and_produce", [])
    register_backend(Backend("route_gather_and_produce", "test-refuse", 0, ("cpu",), lambda *a: None,
                             supports=lambda *a: "refused by the test"))
    with fake_group(2) as group:
        model = lmf.KimiK3MoEBlock(CFG, tp_group=group, sequence_parallel=True, dtype=BF16)
        report, _ = _fuse(model, (_x(),))
    _gathered_before(report, "lmf::route_gather_and_produce refused it: no backend of lmf::route_gather_and_produce "
                             "serves this block on cpu (test-refuse: refused by the test)")


def test_switch_is_part_of_the_cache_key():
    on, off = lmf.LatentMoEFusionPass(), lmf.LatentMoEFusionPass(FusionConfig(gather_tokens=False))
    assert on.uuid() != off.uuid()
    assert "router/with_token_gather" in on.config.pattern_set()
    assert "router/with_token_gather" not in off.config.pattern_set()
    assert "router/with_token_gather" not in FusionConfig(shared_first=False).pattern_set()
