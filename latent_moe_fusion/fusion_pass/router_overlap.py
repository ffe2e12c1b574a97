"""The router beside the down-projection: a fused router (lmf::noaux_tc_route, routing.py) whose logits
come from a gate GEMM of the tokens x, and the latent down-projection z = x @ W_down^T of the same x that
feeds the routed experts with those weights, become one lmf::route_and_project (ops/routed/router_fused/route_and_project.py).

    logits = mm.dtype(x, permute(W_gate), float32)                        router_gemm "bf16"
           | mm([convert(] x [, float32)], permute([convert(] W_gate [, float32)]))   "fp32"
    ids, w = noaux_tc_route(logits, bias, ...)
    z      = mm(x, permute(W_down))
    ...    = routed_experts | moe_shared_producer (z, ids', w', ...)     ids', w': the route's, or a few
                                                                         nodes on (EP share, a scaling)

The op computes each output with the same calls, so no bit changes; on CUDA it runs the down-projection
on a side stream beside the router chain, which the single-stream compiled graph serialises. Like the
other finders it gives a reason when it leaves a router alone.

Where the consumer is the fused block's lmf::moe_shared_producer, fed by the route's ids and weights and
the down-projection directly (nothing else uses them), the three go further, into one
lmf::route_and_produce (ops/routed/router_fused/route_and_produce.py), which starts the shared expert first on CUDA
(FusionConfig.shared_first), up to SHARED_FIRST_MAX_TOKENS tokens.

Where that producer is an SP block's (layout token_publish) and its x_s is the all-gather of the router's tokens,

    x_s = wait_tensor(all_gather_into_tensor(x, R, group))      x: the node the router GEMM and the down-projection
                                                                read; R, group: the block's reduce-scatter's (the
                                                                producer's group and ws [M, R, H]); along dim 0;
                                                                the wait read by the producer alone (before the
                                                                block's rewrite: by the shared gate/up matmuls)

the gather goes in too, into lmf::route_gather_and_produce (ops/routed/router_fused/route_gather_and_produce.py),
which gathers on the shared expert's stream beside the router and the down-projection (FusionConfig.gather_tokens),
at every token count: the gather it hides grows with the tokens. Anything else keeps lmf::route_and_produce with the
gather before it, and the reason in the report (gather_reason).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from ..ops.routed.router_fused.route_and_produce import SHARED_FIRST_MAX_TOKENS
from ..ops.routed.router_fused.route_and_project import OVERLAP_MAX_TOKENS
from .candidates import other_matmul
from .capabilities import Capabilities
from .checks import serving_backend
from .config import FusionConfig
from .node_args import check_all_walked, target_name
from .reject import Reject
from .routing import _is, _val

aten = torch.ops.aten
prims = torch.ops.prims
ROUTE = torch.ops.lmf.noaux_tc_route.default
ROUTE_AND_PROJECT = torch.ops.lmf.route_and_project.default
ROUTE_AND_PRODUCE = torch.ops.lmf.route_and_produce.default
ROUTE_GATHER_AND_PRODUCE = torch.ops.lmf.route_gather_and_produce.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
PRODUCER = torch.ops.lmf.moe_shared_producer.default
ROUTED_CONSUMERS = (torch.ops.lmf.routed_experts.default, torch.ops.lmf.moe_shared_producer.default)


@dataclass
class OverlapMatch:
    route: fx.Node
    reason: str | None = None
    x: fx.Node | None = None
    gate_weight: fx.Node | None = None
    w_down: fx.Node | None = None
    router_gemm: str = ""
    logits: fx.Node | None = None
    down: fx.Node | None = None  # the down-projection's mm
    outputs: tuple[fx.Node | None, fx.Node | None] = (None, None)  # the route's ids / weights getitems
    removable: list[fx.Node] = field(default_factory=list)  # erased when they lose their users
    fake_outputs: tuple | None = None
    consumer: fx.Node | None = None  # the routed-expert op the route and the down-projection feed
    with_producer: bool = False  # the consumer goes into the op too: lmf::route_and_produce
    # with_producer and the SP tokens' all-gather too (lmf::route_gather_and_produce): the gather and its wait
    gather: tuple[fx.Node, fx.Node] | None = None
    gather_reason: str | None = None  # why an SP producer's gather stays before the op

    @property
    def where(self) -> str:
        return f"{self.logits.name if self.logits else '?'} + {self.down.name if self.down else '?'}"


def _transposed_weight(node) -> fx.Node:
    if not (_is(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        raise Reject(f"{getattr(node, 'name', node)} is not a transposed [N, K] weight")
    return node.args[0]


def _widened(node: fx.Node) -> fx.Node:
    """The tensor before an FP32 conversion (or the node itself when it is FP32 already)."""
    if _is(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
        return node.args[0]
    return node


def _router_gemm(m: OverlapMatch) -> None:
    logits = m.logits
    out_dtype = logits.args[2] if len(logits.args) > 2 else logits.kwargs.get("out_dtype")
    if _is(logits, aten.mm.dtype) and out_dtype == torch.float32:
        m.router_gemm, m.x, m.gate_weight = "bf16", logits.args[0], _transposed_weight(logits.args[1])
        m.removable = [logits.args[1]]
    elif _is(logits, aten.mm.default):
        widened_gate = _transposed_weight(logits.args[1])
        m.router_gemm, m.x, m.gate_weight = "fp32", _widened(logits.args[0]), _widened(widened_gate)
        m.removable = [logits.args[1], widened_gate, logits.args[0]]
    elif (why := other_matmul(logits)) is not None:
        raise Reject(f"the router's gate GEMM {logits.name} ({target_name(logits.target)}) {why}")
    else:
        raise Reject(f"the router logits {logits.name} are not a gate GEMM (mm or mm with an FP32 output)")
    x = _val(m.x)
    if x is None or x.dim() != 2:
        raise Reject(f"the router's tokens {m.x.name} are not a 2-D tensor")


def _only_used_by(node: fx.Node | None, user: fx.Node) -> bool:
    return node is None or set(node.users) == {user}


def _takes_producer(m: OverlapMatch, shared_first: bool, gather_tokens: bool) -> None:
    """Whether the consumer goes into the op (lmf::route_and_produce), and with it an SP block's token gather
    (lmf::route_gather_and_produce); then the size bound."""
    c = m.consumer
    m.with_producer = (shared_first and _is(c, PRODUCER) and set(c.kwargs) <= {"group_name"}
                       and c.args[0] is m.down and c.args[1] is m.outputs[0]
                       and c.args[2] is m.outputs[1] and all(_only_used_by(n, c) for n in (m.down, *m.outputs)))
    if m.with_producer and c.args[16] == "token_publish":
        if not gather_tokens:
            m.gather_reason = "FusionConfig.gather_tokens is off"
        else:
            try:
                m.gather = _token_gather(m)
            except Reject as exc:
                m.gather_reason = str(exc)
            except Exception as exc:  # an unexpected graph keeps today's op
                m.gather_reason = f"could not analyse the tokens' gather ({type(exc).__name__}: {exc})"
    _size_bound(m)


def _size_bound(m: OverlapMatch) -> None:
    """Reject a static batch the op would only slow down. The gathering op has no bound: what it hides, the
    tokens' gather, grows with the tokens."""
    if m.gather is not None:
        return
    tokens = _val(m.x).shape[0]
    limit = SHARED_FIRST_MAX_TOKENS if m.with_producer else OVERLAP_MAX_TOKENS
    if isinstance(tokens, int) and tokens > limit:
        # The op would run its parts in a row (two streams measured slower there); outside CUDA graphs its
        # host time before the first launch would only delay the forward (H200, M = 4096: +2-4 %).
        raise Reject(f"M = {tokens} tokens > {limit}: side by side only pays at decode sizes, "
                     "the router and the down-projection stay in a row as compiled")


def _argument(node: fx.Node, index: int, name: str, default=None):
    """A node's argument given by position or by keyword."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _producer_group(c: fx.Node) -> str | None:
    return _argument(c, 17, "group_name")


def _token_gather(m: OverlapMatch) -> tuple[fx.Node, fx.Node]:
    """(all_gather_into_tensor, wait_tensor) where the SP producer's x_s is the gather of the router's tokens that
    the op can take in (module docstring); raises Reject saying why not."""
    c = m.consumer
    x_s = c.args[12]
    if not _is(x_s, WAIT) or not _is(x_s.args[0], ALL_GATHER):
        raise Reject(f"the shared expert's tokens {getattr(x_s, 'name', x_s)} are not wait_tensor(all_gather_into_tensor"
                     "(...)) (a gather along dim 0)")
    gather = x_s.args[0]
    check_all_walked([x_s, gather], "the SP tokens' all-gather:")
    tokens, group_size, group_name = (_argument(gather, i, name)
                                      for i, name in enumerate(("input", "group_size", "group_name")))
    if tokens is not m.x:
        raise Reject(f"{gather.name} gathers {getattr(tokens, 'name', tokens)}, not the tokens {m.x.name} the router "
                     "GEMM and the down-projection read")
    group = _producer_group(c)
    if group_name != group:
        raise Reject(f"{gather.name} gathers over group {group_name!r}, the block's reduce-scatter over {group!r}")
    ws = _as_tensor(c.meta["val"][1]) if isinstance(c.meta.get("val"), (tuple, list)) else None
    if ws is None or ws.dim() != 3:
        raise Reject(f"the producer {c.name} carries no [M, R, H] fragments to read the block's R from")
    if group_size != ws.shape[1]:
        raise Reject(f"{gather.name} gathers from {group_size!r} ranks, the block's reduce-scatter from {ws.shape[1]}")
    for node, user in ((x_s, c), (gather, x_s)):
        extra = [u.name for u in node.users if u is not user]
        if extra:
            what = "the gathered tokens" if node is x_s else "the all-gather"
            raise Reject(f"{what} {node.name} also used by {', '.join(extra)}; the op does not return them")
    return gather, x_s


def drop_gather(m: OverlapMatch, reason: str) -> None:
    """Back to lmf::route_and_produce with the gather before it (the gathering op refused); raises Reject where
    that op is not taken either (the size bound)."""
    m.gather, m.gather_reason = None, reason
    _size_bound(m)


def _routed_consumers(outputs: tuple[fx.Node | None, ...], max_hops: int = 4) -> list[fx.Node]:
    """Routed-expert ops whose ids or weights are the route's outputs or come from them through a few
    nodes (the EP share, a scaling Inductor left as a multiply): the block this router feeds."""
    frontier = [o for o in outputs if o is not None]
    seen, found = set(frontier), []
    for _ in range(max_hops):
        nxt = []
        for node in frontier:
            for user in node.users:
                if any(_is(user, t) for t in ROUTED_CONSUMERS):
                    if (user.args[1] in seen or user.args[2] in seen) and user not in found:
                        found.append(user)
                elif user not in seen:
                    seen.add(user)
                    nxt.append(user)
        frontier = nxt
    return found


def _down_projection(m: OverlapMatch) -> None:
    consumers = _routed_consumers(m.outputs)
    if len(consumers) != 1:
        raise Reject(f"the router's ids and weights feed {len(consumers)} routed-expert ops (lmf::routed_experts or "
                     "lmf::moe_shared_producer), not one: no down-projection to run beside it")
    z = consumers[0].args[0]
    if not _is(z, aten.mm.default) or z.args[0] is not m.x:
        raise Reject(f"the routed experts' input {getattr(z, 'name', z)} is not x @ W_down^T of the router's "
                     f"tokens {m.x.name}")
    m.down, m.w_down, m.consumer = z, _transposed_weight(z.args[1]), consumers[0]
    m.removable.append(z.args[1])


def find_overlap(graph: fx.Graph, route: fx.Node, shared_first: bool = True, gather_tokens: bool = True) -> OverlapMatch:
    """The match for one fused router, with the reason filled in when it cannot go beside a down-projection.
    shared_first: take a directly fed lmf::moe_shared_producer into the op too (lmf::route_and_produce);
    gather_tokens: and an SP producer's token gather (lmf::route_gather_and_produce)."""
    m = OverlapMatch(route=route)
    try:
        getitems = list(route.users)
        if not all(_is(u, operator.getitem) for u in getitems):
            raise Reject(f"{route.name} is used other than through its two outputs")
        by_index = {u.args[1]: u for u in getitems}
        m.outputs = (by_index.get(0), by_index.get(1))
        if m.outputs[1] is None:
            raise Reject("the router's weights are unused")
        m.logits = route.args[0]
        extra = [u.name for u in m.logits.users if u is not route]
        if extra:
            raise Reject(f"the router logits {m.logits.name} are also used by {', '.join(extra)}")
        _router_gemm(m)
        _down_projection(m)
        inputs = (m.x, m.gate_weight, m.w_down)
        check_all_walked([m.logits, m.down, *(n for n in m.removable if all(n is not i for i in inputs))],
                         "the router GEMM or the down-projection:")
        _takes_producer(m, shared_first, gather_tokens)
        order = {node: i for i, node in enumerate(graph.nodes)}
        first = min(order[m.logits], order[m.down])
        late = [n.name for n in (m.x, m.gate_weight, route.args[1], m.w_down) if order[n] > first]
        if late:
            raise Reject(f"{', '.join(late)} computed after the first GEMM; the op could not go in its place")
    except Reject as exc:
        m.reason = str(exc)
    except Exception as exc:  # an unexpected graph never breaks the compile
        m.reason = f"could not analyse the router's GEMM ({type(exc).__name__}: {exc})"
    return m


def _args(m: OverlapMatch) -> tuple:
    route_args = (m.x, m.gate_weight, m.route.args[1], m.w_down, m.router_gemm, *m.route.args[2:7])
    if not m.with_producer:
        return route_args
    c = m.consumer
    if m.gather is not None:  # the producer's arguments with R in x_s's place, without the layout
        group_size = _argument(m.gather[0], 1, "group_size")
        return route_args + tuple(c.args[3:12]) + (group_size,) + tuple(c.args[13:16]) + (_producer_group(c),)
    return route_args + tuple(c.args[3:]) + ((c.kwargs["group_name"],) if "group_name" in c.kwargs else ())


def _op(m: OverlapMatch) -> tuple[torch._ops.OpOverload, str]:
    """The op the match goes into, and its name."""
    if m.gather is not None:
        return ROUTE_GATHER_AND_PRODUCE, "route_gather_and_produce"
    return (ROUTE_AND_PRODUCE, "route_and_produce") if m.with_producer else (ROUTE_AND_PROJECT, "route_and_project")


def _as_tensor(val) -> torch.Tensor | None:
    return val if isinstance(val, torch.Tensor) else None


def _same(val, want) -> bool:
    return val is not None and val.dtype == want.dtype and tuple(val.shape) == tuple(want.shape)


def check_overlap(m: OverlapMatch, config: FusionConfig, caps: Capabilities) -> str:
    """The backend that will serve the op; raises Reject when none can."""
    vals = [_val(a) if isinstance(a, fx.Node) else a for a in _args(m)]
    op, op_name = _op(m)
    fake_mode = getattr(vals[0], "fake_mode", None)
    if fake_mode is None or any(v is None for v in vals[:4]):
        raise Reject(f"the graph has no fake tensors to check lmf::{op_name} with")
    with fake_mode:
        try:
            m.fake_outputs = op(*vals)
        except Exception as exc:
            raise Reject(f"lmf::{op_name} refuses the matched arguments ({type(exc).__name__}: {exc})") from exc
    if m.with_producer:
        produced = m.consumer.meta.get("val")
        if not (isinstance(produced, (tuple, list)) and len(produced) == len(m.fake_outputs)
                and all(_same(_as_tensor(v), w) for v, w in zip(produced, m.fake_outputs, strict=True))):
            raise Reject(f"the producer {m.consumer.name}'s outputs are not those of lmf::{op_name}")
    elif not _same(_val(m.down), m.fake_outputs[2]):
        raise Reject(f"the down-projection {m.down.name} is not [M, L] in x's dtype")
    return serving_backend(op_name, vals[0].device.type, tuple(vals), config, caps)


def rewrite_overlap(graph: fx.Graph, m: OverlapMatch) -> None:
    """Replace the router GEMM, the route and the down-projection (and the producer) by the op (check_overlap
    first)."""
    if m.with_producer:
        _rewrite_with_producer(graph, m)
        return
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = m.logits if order[m.logits] < order[m.down] else m.down
    with graph.inserting_before(first):
        op = graph.call_function(ROUTE_AND_PROJECT, _args(m))
        outs = [graph.call_function(operator.getitem, (op, i)) for i in range(3)]
    op.meta["val"] = m.fake_outputs
    for node, val in zip(outs, m.fake_outputs, strict=True):
        node.meta["val"] = val
    for old, new in zip((*m.outputs, m.down), outs, strict=True):
        if old is not None:
            old.replace_all_uses_with(new)
    _erase_replaced(graph, m)


def _rewrite_with_producer(graph: fx.Graph, m: OverlapMatch) -> None:
    """lmf::route_and_produce (or lmf::route_gather_and_produce) in the producer's place (every argument of both is
    defined there); the producer's output getitems then read the op, whose outputs are the producer's."""
    with graph.inserting_before(m.consumer):
        op = graph.call_function(_op(m)[0], _args(m))
    op.meta["val"] = m.fake_outputs
    m.consumer.replace_all_uses_with(op)
    graph.erase_node(m.consumer)
    if m.gather is not None:  # the op gathers the tokens itself
        gather, wait = m.gather
        graph.erase_node(wait)
        graph.erase_node(gather)
    _erase_replaced(graph, m)


def _erase_replaced(graph: fx.Graph, m: OverlapMatch) -> None:
    """The matched nodes the op replaced, once they have lost their users."""
    for node in (*m.outputs, m.route, m.logits, m.down, *m.removable):
        if node is not None and node.op == "call_function" and not node.users:
            graph.erase_node(node)
