"""The router fusion: sigmoid -> + correction bias -> topk -> gather / renormalise [-> EP share] becomes
one lmf::noaux_tc_route (ops/router/noaux_tc_route.py; its math in ops/common/route_math.py), whose ids are bitwise those of the CUDA chain it replaces.

The chain, as model/router.py writes it and Inductor's post-grad graph holds it:

    scores = sigmoid(logits);  idx = topk(scores + bias, k, -1, largest=True, sorted=False)[1]
    w      = gather(scores, -1, idx);  w = w / (sum(w, -1, keepdim) [+ eps]) [* scale]
    ids    = idx.to(int32) [- first;  where((ids >= 0) & (ids < num_local), ids, full(-1))]

Like the block walk (candidates.py) it is a finder that gives every topk a reason when it leaves it
alone: every intermediate must be used only inside the chain, since the op returns just ids and weights.
The optional EP localisation is folded in when it matches exactly, and left to Inductor otherwise.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from .capabilities import Capabilities
from .checks import serving_backend
from .config import FusionConfig
from .node_args import WALK_READS, check_all_walked, check_walked, describe_stray, stray_arguments
from .reject import Reject

aten = torch.ops.aten
prims = torch.ops.prims
ROUTE = torch.ops.lmf.noaux_tc_route.default
TOPK = aten.topk.default


@dataclass
class RoutingMatch:
    topk: fx.Node
    where: str
    reason: str | None = None
    logits: fx.Node | None = None
    bias: fx.Node | None = None
    top_k: int = 0
    renorm_eps: float = 0.0
    scaling_factor: float = 1.0
    first_expert: int = 0
    num_local: int = 0
    localized: bool = False
    ids_out: fx.Node | None = None  # the op's ids replace this node's value
    weights_out: fx.Node | None = None  # the op's weights replace this one's
    chain: list[fx.Node] = field(default_factory=list)  # erased after the rewrite
    backend: str | None = None
    fake_outputs: tuple | None = None  # the op's (ids, weights) on the graph's fake values, from check_routing
    share_reason: str | None = None  # why an EP share after the ids was not folded in (left to Inductor)


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _users_exactly(node: fx.Node, expected: set[fx.Node], what: str) -> None:
    extra = [u.name for u in node.users if u not in expected]
    if extra:
        raise Reject(f"{what} ({node.name}) is also used by {', '.join(extra)}; the fused router returns only ids and weights")


def _arg(node: fx.Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def find_routings(graph: fx.Graph) -> list[RoutingMatch]:
    """One RoutingMatch per aten.topk node, with the chain filled in or the reason it does not fit."""
    found = []
    for node in graph.nodes:
        if _is(node, TOPK):
            match = RoutingMatch(topk=node, where=node.name)
            try:
                _walk(match)
            except Reject as exc:
                match.reason = str(exc)
            except Exception as exc:  # an unexpected graph never breaks the compile: leave it alone
                match.reason = f"could not analyse the router ({type(exc).__name__}: {exc})"
            found.append(match)
    return found


def _walk(m: RoutingMatch) -> None:
    topk = m.topk
    biased = topk.args[0]
    m.top_k = _arg(topk, 1, "k", None)
    dim, largest, ordered = _arg(topk, 2, "dim", -1), _arg(topk, 3, "largest", True), _arg(topk, 4, "sorted", True)
    val = _val(biased)
    if val is None or val.dim() != 2 or val.dtype != torch.float32:
        raise Reject("topk input is not a 2-D float32 tensor of biased scores")
    if dim not in (-1, 1) or not largest:
        raise Reject(f"topk(dim={dim}, largest={largest}): the router takes the largest along the experts (last dim)")
    if ordered:
        raise Reject("topk(sorted=True) orders ids by score; the fused router reproduces sorted=False's order")
    if not isinstance(m.top_k, int):
        raise Reject(f"top_k {m.top_k!r} is not a constant int")
    if not _is(biased, aten.add.Tensor) or len(biased.args) != 2:
        raise Reject(f"topk input {getattr(biased, 'name', biased)} is not sigmoid(logits) + bias")
    sigmoid = next((a for a in biased.args if _is(a, aten.sigmoid.default)), None)
    bias = next((a for a in biased.args if a is not sigmoid), None)
    if sigmoid is None or not isinstance(bias, fx.Node):
        raise Reject(f"topk input {biased.name} is not sigmoid(logits) + bias")
    m.logits, m.bias = sigmoid.args[0], bias
    logits, bias_val = _val(m.logits), _val(bias)
    if logits is None or logits.dim() != 2 or logits.dtype != torch.float32:
        raise Reject("router logits are not a 2-D float32 tensor")
    num_experts = logits.shape[1]
    if bias_val is None or bias_val.dim() != 1 or bias_val.dtype != torch.float32:
        raise Reject(f"correction bias {bias.name} is not a 1-D float32 tensor")
    if not isinstance(num_experts, int) or bias_val.shape[0] != num_experts:
        raise Reject(f"correction bias has {bias_val.shape[0]} entries for {num_experts} experts")

    getitems = list(topk.users)
    if not all(_is(u, operator.getitem) for u in getitems):
        raise Reject(f"topk {topk.name} is used other than through its two outputs")
    if any(u.args[1] == 0 and u.users for u in getitems):
        raise Reject("topk's values are used; the fused router returns only ids and weights")
    idx = next((u for u in getitems if u.args[1] == 1), None)
    if idx is None:
        raise Reject("topk's indices are unused")
    gather = next((u for u in idx.users if _is(u, aten.gather.default)), None)
    to_int32 = next((u for u in idx.users if _is(u, prims.convert_element_type.default) and u.args[1] == torch.int32), None)
    if gather is None or gather.args[0] is not sigmoid or gather.args[1] not in (-1, 1):
        raise Reject("the scores of the chosen experts are not gathered from sigmoid(logits) along the experts")
    if to_int32 is None:
        raise Reject("the chosen ids are not converted to int32 (the fused router returns int32 ids)")
    _users_exactly(idx, {gather, to_int32}, "topk indices")
    _users_exactly(sigmoid, {biased, gather}, "router scores")
    _users_exactly(biased, {topk}, "biased scores")
    weights_chain = _renormalisation(m, gather)
    m.ids_out, ids_chain = _localisation(m, to_int32, num_experts)
    m.chain = [sigmoid, biased, topk, *getitems, gather, *weights_chain, to_int32, *ids_chain]
    check_all_walked(m.chain, "router node")
    m.where = f"{sigmoid.name} -> {topk.name} -> {m.weights_out.name}, {m.ids_out.name}"


def _renormalisation(m: RoutingMatch, gather: fx.Node) -> list[fx.Node]:
    """w / (sum(w) [+ eps]) [* scale]: fills renorm_eps, scaling_factor and weights_out."""
    total = next((u for u in gather.users if _is(u, aten.sum.dim_IntList)), None)
    div = next((u for u in gather.users if _is(u, aten.div.Tensor) and u.args[0] is gather), None)
    if total is None or div is None or list(total.args[1]) not in ([-1], [1]) or not _arg(total, 2, "keepdim", False):
        raise Reject("the gathered scores are not renormalised as w / w.sum(-1, keepdim=True)")
    check_walked(total, "the renormalisation sum")  # a dtype= cast is refused here, by name
    _users_exactly(gather, {total, div}, "gathered scores")
    chain = [total]
    denom = div.args[1]
    if denom is total:
        m.renorm_eps = 0.0
    elif _is(denom, aten.add.Tensor) and denom.args[0] is total and isinstance(denom.args[1], float):
        m.renorm_eps = denom.args[1]
        _users_exactly(denom, {div}, "renormalisation denominator")
        chain.append(denom)
    else:
        raise Reject(f"the renormalisation divides by {getattr(denom, 'name', denom)}, not sum(w) + eps")
    _users_exactly(total, {denom if denom is not total else div}, "renormalisation sum")
    chain.append(div)
    users = list(div.users)
    if len(users) == 1 and _is(users[0], aten.mul.Tensor) and users[0].args[0] is div and isinstance(users[0].args[1], (int, float)):
        m.scaling_factor, m.weights_out = float(users[0].args[1]), users[0]
        chain.append(users[0])
    else:
        m.scaling_factor, m.weights_out = 1.0, div
    return chain


# The -1 fill of the EP share as the fold computes it; any other dtype, layout or pinning is another tensor.
_FILL_KWARGS = {"dtype": (torch.int32,), "layout": (None, torch.strided), "pin_memory": (None, False)}


def _localisation(m: RoutingMatch, ids: fx.Node, num_experts: int) -> tuple[fx.Node, list[fx.Node]]:
    """ids - first, kept where 0 <= . < num_local, else -1 (model/router.localize_ids): folded into the op
    when it is exactly that; otherwise the op's ids replace the int32 ids, Inductor keeps the rest, and
    m.share_reason says why when the ids go on into a subtraction (what an EP share starts with)."""
    m.first_expert, m.num_local, m.localized = 0, num_experts, False
    users = list(ids.users)
    sub = users[0] if len(users) == 1 and _is(users[0], aten.sub.Tensor) else None
    # ids - first; a compiler may drop the subtraction where first is 0 (torch 2.14 removes `ids - 0`), so the
    # share is recognised from ids themselves too
    shifted = sub if sub is not None else ids
    by_target = {u.target: u for u in shifted.users}
    ge, lt, where = by_target.get(aten.ge.Scalar), by_target.get(aten.lt.Scalar), by_target.get(aten.where.self)
    if sub is None and (None in (ge, lt, where) or len(ids.users) != 3):
        return ids, []  # no EP share after the ids
    if sub is not None and (not (sub.args[0] is ids and isinstance(sub.args[1], int))
                            or None in (ge, lt, where) or len(sub.users) != 3):
        m.share_reason = f"{sub.name} is not ids - first read by one >= 0, one < num_local and one where"
        return ids, []
    both, kept, fill = where.args
    first, num_local = (sub.args[1] if sub is not None else 0), lt.args[1]
    fold = [n for n in (sub, ge, lt, both, fill, where) if n is not None]
    for node in fold:
        stray = stray_arguments(node, WALK_READS.get(node.target, ())) if node.op == "call_function" else []
        if node is fill and _is(fill, aten.full.default):
            stray += [(k, fill.kwargs.get(k)) for k, ok in _FILL_KWARGS.items() if fill.kwargs.get(k) not in ok
                      and (k, fill.kwargs.get(k)) not in stray]
        if stray:
            m.share_reason = describe_stray(node, stray, "EP share node")
            return ids, []
    if not (ge.args == (shifted, 0) and lt.args[0] is shifted and isinstance(num_local, int) and kept is shifted
            and _is(both, aten.bitwise_and.Tensor) and set(both.args) == {ge, lt} and len(both.users) == 1
            and len(ge.users) == 1 and len(lt.users) == 1 and _is(fill, aten.full.default) and fill.args[1] == -1
            and len(fill.users) == 1 and 0 <= first < num_experts and 1 <= num_local <= num_experts - first
            and getattr(_val(where), "dtype", None) == torch.int32
            and tuple(getattr(_val(where), "shape", ())) == tuple(getattr(_val(ids), "shape", (None,)))):
        m.share_reason = (f"{where.name} is not exactly where((ids - first >= 0) & (ids - first < num_local), "
                          "ids - first, -1) in int32 with 0 <= first < first + num_local <= experts")
        return ids, []
    m.first_expert, m.num_local, m.localized = first, num_local, True
    return where, fold


def check_routing(m: RoutingMatch, config: FusionConfig, caps: Capabilities) -> str:
    """The backend that will serve the op; raises Reject when none can. Keeps the op's fake outputs (its
    argument checks ran to make them) for rewrite_routing's node metadata."""
    logits = _val(m.logits)
    fake_mode = getattr(logits, "fake_mode", None)
    if fake_mode is None:
        raise Reject("the graph has no fake tensors to check the fused router with")
    args = (logits, _val(m.bias), m.top_k, m.renorm_eps, m.scaling_factor, m.first_expert, m.num_local)
    with fake_mode:
        try:
            m.fake_outputs = ROUTE(*args)  # the op's own argument checks
        except Exception as exc:
            raise Reject(f"lmf::noaux_tc_route refuses the matched arguments ({type(exc).__name__}: {exc})") from exc
        return serving_backend("noaux_tc_route", logits.device.type, args, config, caps)


def rewrite_routing(graph: fx.Graph, m: RoutingMatch) -> fx.Node:
    """Replace the checked chain (check_routing first) by the op; returns the op's node."""
    args = (m.logits, m.bias, m.top_k, m.renorm_eps, m.scaling_factor, m.first_expert, m.num_local)
    ids_val, weights_val = m.fake_outputs
    with graph.inserting_before(m.topk):
        route = graph.call_function(ROUTE, args)
        ids = graph.call_function(operator.getitem, (route, 0))
        weights = graph.call_function(operator.getitem, (route, 1))
    route.meta["val"] = (ids_val, weights_val)
    ids.meta["val"], weights.meta["val"] = ids_val, weights_val
    m.ids_out.replace_all_uses_with(ids)
    m.weights_out.replace_all_uses_with(weights)
    for node in reversed(m.chain):
        if not node.users:
            graph.erase_node(node)
    return route
