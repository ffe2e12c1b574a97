"""The pass fails closed on every argument of every node it consumes.

Inductor's pattern matcher drops the keyword arguments a pattern does not name, so `torch.add(u, s, alpha=0.5)`
once fused as `u + s`. These tests take the post-grad graphs of real blocks, find every node the pass consumes
(block, router, EP share, router GEMM and down-projection), give each in turn a non-default value for each
argument it does not carry (and an argument no schema has), and check that the pass then leaves that node in the graph and says why, naming
the node and the argument. End-to-end models with such arguments compile to what they compile to without
the pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass.node_args import stray_arguments
from latent_moe_fusion.model import router as model_router
from latent_moe_fusion.model.layers import RMS_NORMS
from tests.fusion_models import CFG, Stop, block, compiled, fake_group, post_grad, rel_l2

BF16 = torch.bfloat16


def _copy(graph: fx.Graph) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    new = fx.Graph(owning_module=graph.owning_module)
    env: dict[fx.Node, fx.Node] = {}
    new.output(new.graph_copy(graph, env))
    return new, env


def _non_default(arg: torch._C.Argument):
    """A value of the argument's type that is not its default, or None where none is obvious."""
    by_name = {"dtype": torch.float64, "out_dtype": torch.float64, "memory_format": torch.channels_last,
               "layout": torch.sparse_coo, "device": torch.device("meta"), "pin_memory": True}
    if arg.name in by_name:
        return by_name[arg.name]
    kind, default = str(arg.type), arg.default_value
    if "bool" in kind:
        return not default
    if any(word in kind for word in ("Scalar", "float", "int", "number")):
        return (default or 0) + 2
    if "str" in kind:
        return "trunc"
    return None


def _reasons(report) -> str:
    parts = [r for _, r in report.rejected] + [r for _, r in report.routing_rejected]
    parts += [r.beside_reason or "" for r in report.routings] + [r.share_reason or "" for r in report.routings]
    return "\n".join(parts)


class _Mutations(CustomGraphPass):
    """Runs, inside the compile, one fresh fusion pass on a pristine copy of the graph (to learn what it
    consumes) and one on a copy per (consumed node, argument it does not carry) with that argument set."""

    def __init__(self) -> None:
        self.consumed: list[str] = []
        self.tried: list[tuple[str, str, str]] = []  # (node, target, argument)
        self.failures: list[str] = []
        self.pristine_report = None

    def __call__(self, graph: fx.Graph) -> None:
        copy, _ = _copy(graph)
        names_before = {n.name for n in copy.nodes}
        fusion = lmf.LatentMoEFusionPass()
        fusion(copy)
        self.pristine_report = fusion.report
        names_after = {n.name for n in copy.nodes}
        by_name = {n.name: n for n in graph.nodes}
        self.consumed = sorted(names_before - names_after)
        for name in self.consumed:
            node = by_name[name]
            if node.op != "call_function":
                continue
            # an argument no schema has: covers every consumed node, those whose targets take no keyword too
            self._try(graph, name, "lmf_unknown", 1)
            schema = getattr(node.target, "_schema", None)
            for i, arg in enumerate(schema.arguments if schema is not None else ()):
                value = _non_default(arg) if arg.has_default_value() else None
                if i < len(node.args) or arg.name in node.kwargs or value is None:
                    continue
                self._try(graph, name, arg.name, value)

    def _try(self, graph: fx.Graph, name: str, arg: str, value) -> None:
        copy, env = _copy(graph)
        node = next(n for old, n in env.items() if old.name == name)
        node.kwargs = {**node.kwargs, arg: value}
        self.tried.append((name, str(node.target), arg))
        fusion = lmf.LatentMoEFusionPass()
        try:
            fusion(copy)
        except Exception as exc:  # the pass must never raise on a graph it is given
            self.failures.append(f"{name}.{arg}={value!r}: the pass raised {type(exc).__name__}: {exc}")
            return
        if node not in set(copy.nodes):
            self.failures.append(f"{name} ({node.target}) with {arg}={value!r} was consumed by the pass")
            return
        reasons = _reasons(fusion.report)
        if name not in reasons or f"{arg}=" not in reasons:
            self.failures.append(f"{name} ({node.target}) with {arg}={value!r}: no reason names it:\n{reasons}")

    def uuid(self) -> None:
        return None


def _mutate(model, args) -> _Mutations:
    mutations = _Mutations()
    post_grad(model, args, lmf.fusion_pass.ChainedGraphPass(mutations, Stop()))
    assert mutations.pristine_report.matched >= 1 and mutations.pristine_report.routings, \
        mutations.pristine_report.summary()
    return mutations


MODELS = {
    # F.rms_norm (add.Scalar, mean.dim), split gate/up, MXFP4 weights, the router with an EP share
    "functional-split-mxfp4-ep": lambda: block(3, dtype=BF16, weight_format="mxfp4", shared_gate_up="split",
                                               rms_norm="functional", ep_size=2, ep_rank=1),
    # manual float32 RMSNorm (add.Tensor eps), merged gate/up (split.Tensor), float32 activations
    "manual-merged-fp32": lambda: block(4, dtype=torch.float32, shared_gate_up="merged", rms_norm="manual"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_consumed_node_with_another_argument_is_left_alone_with_its_reason(name):
    model = MODELS[name]()
    dtype = model.w_up.dtype
    mutations = _mutate(model, (torch.randn(6, CFG.hidden_size, dtype=dtype),))
    assert not mutations.failures, "\n".join(mutations.failures)
    kinds = {target for _, target, _ in mutations.tried}
    # every kind of consumed node that takes a keyword argument was tried
    expected = {"aten.add.Tensor", "aten.gather.default", "aten.sum.dim_IntList", "aten.mean.dim"}
    expected |= {"aten.add.Scalar", "aten.sub.Tensor"} if name.endswith("-ep") else set()
    assert expected <= kinds, (sorted(kinds), sorted(expected - kinds))
    tried_nodes = {node for node, _, _ in mutations.tried}
    assert tried_nodes == set(mutations.consumed)  # every consumed node was tried


def test_tensor_parallel_collectives_carry_no_argument_to_drop():
    """all_reduce / reduce_scatter_tensor / wait_tensor have no argument with a default: the pass reads all of
    theirs (node_args.WALK_READS), so a graph cannot hand it one it would drop."""
    c10d = torch.ops._c10d_functional
    for op in (c10d.all_reduce.default, c10d.reduce_scatter_tensor.default, c10d.wait_tensor.default):
        assert not [a for a in op._schema.arguments if a.has_default_value()], op


def test_stray_arguments_reads_positional_keyword_and_unknown_arguments():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    plain = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    default_alpha = graph.call_function(torch.ops.aten.add.Tensor, (a, b), {"alpha": 1})
    alpha = graph.call_function(torch.ops.aten.add.Tensor, (a, b), {"alpha": 0.5})
    mean = graph.call_function(torch.ops.aten.mean.dim, (a, [-1], True), {"dtype": torch.float64})
    unknown = graph.call_function(torch.ops.aten.sigmoid.default, (a,), {"bogus": 1})
    assert stray_arguments(plain, ("self", "other")) == []
    assert stray_arguments(default_alpha, ("self", "other")) == []
    assert stray_arguments(alpha, ("self", "other")) == [("alpha", 0.5)]
    assert stray_arguments(alpha, ("self", "other", "alpha")) == []
    assert stray_arguments(mean, ("self", "dim", "keepdim")) == [("dtype", torch.float64)]
    assert stray_arguments(mean, ("self", "dim")) == [("keepdim", True), ("dtype", torch.float64)]
    assert stray_arguments(unknown, ("self",)) == [("bogus", 1)]


# -- end to end: the three instances and the EP share, compiled with and without the pass ------------
class _AlphaAdd(lmf.KimiK3MoEBlock):
    def forward(self, x):
        y_n = RMS_NORMS[self.rms_norm_form](self.routed(x), self.norm_weight, self.cfg.rms_norm_eps)
        return torch.add(torch.nn.functional.linear(y_n, self.w_up), self.shared(x), alpha=0.5)


class _AlphaNorm(lmf.KimiK3MoEBlock):
    def forward(self, x):
        y = self.routed(x)
        yf = y.float()
        inverse = torch.rsqrt(torch.add(yf.pow(2).mean(-1, keepdim=True), self.cfg.rms_norm_eps, alpha=1000.0))
        y_n = (yf * inverse * self.norm_weight.float()).to(y.dtype)
        return torch.nn.functional.linear(y_n, self.w_up) + self.shared(x)


def _alpha_router(logits, correction_bias, top_k, scaling_factor):
    scores = torch.sigmoid(logits)
    chosen = torch.topk(torch.add(scores, correction_bias.float(), alpha=-8.0), top_k, dim=-1, sorted=False).indices
    weights = scores.gather(-1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling_factor
    return chosen.to(torch.int32), weights


def _alpha_share(ids, first, num_local):
    shifted = torch.sub(ids, first, alpha=2)
    return torch.where((shifted >= 0) & (shifted < num_local), shifted, torch.full_like(shifted, -1))


END_TO_END = {
    # name: (model, patch of model.router, where the reason is reported, what it must name)
    "final-add-alpha": (lambda: _AlphaAdd(CFG, seed=5, dtype=torch.float32), None, "rejected", "alpha=0.5"),
    "rms-norm-eps-alpha": (lambda: _AlphaNorm(CFG, seed=6, dtype=torch.float32, rms_norm="manual"), None, "rejected",
                           "alpha=1000.0"),
    "router-bias-alpha": (lambda: block(7, dtype=torch.float32), ("route_from_logits", _alpha_router),
                          "routing_rejected", "alpha=-8.0"),
    "ep-share-sub-alpha": (lambda: block(8, dtype=torch.float32, ep_size=2, ep_rank=1),
                           ("localize_ids", _alpha_share), "share_reason", "alpha=2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(END_TO_END))
def test_a_model_with_such_an_argument_compiles_as_without_the_pass(name, monkeypatch):
    make, patch, where, names = END_TO_END[name]
    if patch is not None:
        from latent_moe_fusion.model import block as model_block

        monkeypatch.setattr(model_router, patch[0], patch[1])
        if hasattr(model_block, patch[0]):
            monkeypatch.setattr(model_block, patch[0], patch[1])
    model = make()
    x = torch.randn(6, CFG.hidden_size)
    without = compiled(model, None)(x)
    fusion = lmf.LatentMoEFusionPass()
    with_pass = compiled(model, fusion)(x)
    report = fusion.report
    reasons = {"rejected": [r for _, r in report.rejected], "routing_rejected": [r for _, r in report.routing_rejected],
               "share_reason": [r.share_reason or "" for r in report.routings]}[where]
    assert any(names in r for r in reasons), report.summary()
    assert rel_l2(with_pass, without) <= 1e-6, report.summary()


def test_fake_group_tp_block_with_alpha_add_is_left_alone():
    """The TP form's add reads the waited all_reduce: alpha there is refused the same way."""

    class AlphaTP(lmf.KimiK3MoEBlock):
        def forward(self, x):
            y_n = RMS_NORMS[self.rms_norm_form](self.routed(x), self.norm_weight, self.cfg.rms_norm_eps)
            c10d = torch.ops._c10d_functional
            s = c10d.wait_tensor(c10d.all_reduce(self.shared(x), "sum", self.group_name))
            return torch.add(torch.nn.functional.linear(y_n, self.w_up), s, alpha=2.0)

    with fake_group(2) as group:
        fusion = lmf.LatentMoEFusionPass()
        post_grad(AlphaTP(CFG, tp_group=group, seed=9, dtype=BF16), (torch.randn(4, CFG.hidden_size, dtype=BF16),),
                  fusion)
    assert fusion.report.matched == 0
    assert any("alpha=2.0" in r for _, r in fusion.report.rejected), fusion.report.summary()
