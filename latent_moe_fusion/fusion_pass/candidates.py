"""Find the latent-MoE blocks in a post-grad graph and say, for each, why it can or cannot be fused.

The pattern matcher answers only "matched" or not; this walker gives every candidate a reason. It
anchors on each `lmf::routed_experts` node and follows the block's shape:

    routed -> RMSNorm -> up mm ---------------------------> add (out)
    x_s -> gate/up mm(s) -> SiTU -> down mm -> [collective + wait] -^

Every intermediate must be used only inside the block (the fused ops do not return it). The walk
reads only the graph (same on every rank) and the configuration; the pattern matcher then does the
exact match and the rewrite, and only for candidates accepted here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .config import FusionConfig
from .node_args import check_walked, target_name
from .reject import Reject

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
ROUTED = torch.ops.lmf.routed_experts.default
MM = aten.mm.default
ADD = aten.add.Tensor
COLLECTIVE_FORMS = {
    c10d.all_reduce.default: "all_reduce",
    c10d.reduce_scatter_tensor.default: "sequence_parallel",
}
# Matmul forms other than aten.mm that a projection can take in a post-grad graph, and why the fused ops,
# which take aten.mm with the weight as an input, cannot.
OTHER_MATMULS = {
    "aten.addmm.default": "adds a bias (F.linear with a bias); the fused ops compute the projection without one",
    "aten.mm.dtype": "casts its output (mm with out_dtype); the fused ops keep the activation dtype",
    "aten.bmm.default": "is a batched matmul; the fused ops take a 2-D aten.mm",
    "aten.baddbmm.default": "is a batched matmul with a bias; the fused ops take a 2-D aten.mm",
}
PACKED_LINEAR = ("is a CPU linear on a prepacked weight (Inductor's freezing packs weights on CPU); the fused ops "
                 "take aten.mm with the weight as a graph input, so compile without freezing to fuse")


def other_matmul(node: object) -> str | None:
    """Why `node` is a matmul the fused ops cannot take, or None if it is no matmul (or a plain aten.mm)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is MM:
        return None
    name = target_name(node.target)
    if name in OTHER_MATMULS:
        return OTHER_MATMULS[name]
    if name.startswith(("mkldnn.", "mkl.")) and "linear" in name:
        return PACKED_LINEAR
    parts = name.split(".")  # "namespace.op.overload" (or "namespace.op" for an overload packet)
    if any(word in parts[min(1, len(parts) - 1)] for word in ("mm", "linear", "matmul")):
        return "is a matmul form the fused ops do not take (they match aten.mm)"
    return None


@dataclass
class Candidate:
    routed: fx.Node
    where: str
    reason: str | None = None
    form: str | None = None
    group_name: str | None = None
    world: int = 1
    gate_up: str | None = None  # as seen by the walk: one gate/up matmul or two
    norm_hint: str | None = None  # RMSNorm form the walk guesses (add.Scalar: functional); tried first
    up_mm: fx.Node | None = None
    out: fx.Node | None = None
    shared_mm: fx.Node | None = None
    gate_up_mms: tuple[fx.Node, ...] = ()
    x_s: fx.Node | None = None
    eps: float | None = None
    backends: dict[str, str] | None = None  # op -> backend that will serve it (set when accepted)
    spec: object | None = None  # the PatternSpec that rewrote it (set by the matcher's gate)
    gate_reason: str | None = None  # why the matcher's gate refused a structural match

    @property
    def accepted(self) -> bool:
        return self.reason is None


def find_candidates(graph: fx.Graph, config: FusionConfig) -> list[Candidate]:
    """One Candidate per lmf::routed_experts node, in graph order, with structure filled in or a reason."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is ROUTED:
            cand = Candidate(routed=node, where=node.name)
            try:
                _walk(cand, config, order)
            except Reject as exc:
                cand.reason = str(exc)
            except Exception as exc:  # never let an unexpected graph break the compile: leave it alone
                cand.reason = f"could not analyse the block ({type(exc).__name__}: {exc})"
            found.append(cand)
    return found


def _walk(cand: Candidate, config: FusionConfig, order: dict[fx.Node, int]) -> None:
    cand.up_mm, cand.eps, cand.norm_hint = _norm_chain(cand.routed, config, order)
    check_walked(cand.up_mm, "the routed up-projection")
    cand.out = _single_user(cand.up_mm, "routed up-projection output u")
    if cand.out.op != "call_function" or cand.out.target is not ADD:
        raise Reject(f"routed up-projection output u ({cand.up_mm.name}) feeds {cand.out.name}, not the block's add")
    cand.where = f"{cand.routed.name} -> {cand.out.name}"
    check_walked(cand.out, "the block's add")
    other = [a for a in cand.out.args if isinstance(a, fx.Node) and a is not cand.up_mm]
    if len(other) != 1 or len(cand.out.args) != 2:
        raise Reject(f"the block's add {cand.out.name} does not add u to one shared-expert output")
    cand.shared_mm = _shared_reduction(cand, other[0])
    _shared_expert(cand, config, order)


# -- routed side: RMSNorm then the up-projection --------------------------------------------------
def _norm_chain(routed: fx.Node, config: FusionConfig, order) -> tuple[fx.Node, float | None, str | None]:
    """The up-projection mm reached from the routed output, checking nothing else reads the chain."""
    region: set[fx.Node] = set()
    boundary: set[fx.Node] = set()
    frontier = [routed]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and user.target is MM:
                boundary.add(user)
            elif (why := other_matmul(user)) is not None:
                raise Reject(f"{_describe(node, routed)} feeds {user.name} ({target_name(user.target)}), which {why}")
            elif user not in region:
                if user.op == "output":
                    raise Reject(f"{_describe(node, routed)} is also a graph output; the fused ops do not return it")
                region.add(user)
                frontier.append(user)
                if len(region) > config.max_walk_nodes:
                    raise Reject(f"routed output feeds more than {config.max_walk_nodes} ops before any matmul")
    if not boundary:
        raise Reject("routed output reaches no matmul (expected RMSNorm, then the up-projection)")
    if len(boundary) > 1:
        names = ", ".join(sorted(n.name for n in boundary))
        raise Reject(f"routed output (or its RMSNorm) feeds several matmuls ({names}); the fused op returns only u")
    (up_mm,) = boundary
    chain = _ancestors_within(up_mm.args[0], region | {routed})
    extra = sorted(region - chain, key=order.__getitem__)
    if extra:
        user = extra[0]
        source = next(a for a in user.all_input_nodes if a in chain or a is routed)
        raise Reject(f"{_describe(source, routed)} also used by {user.name}, outside the RMSNorm -> up-projection chain")
    if up_mm.args[0] is routed:
        raise Reject("routed output goes into the up-projection without an RMSNorm")
    eps, norm_hint = _find_eps(chain)
    return up_mm, eps, norm_hint


def _describe(node: fx.Node, routed: fx.Node) -> str:
    return f"routed-expert output y ({node.name})" if node is routed else f"RMSNorm intermediate {node.name}"


def _ancestors_within(start, allowed: set[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [start] if isinstance(start, fx.Node) else []
    while stack:
        node = stack.pop()
        if node in seen or node not in allowed:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def _find_eps(chain: set[fx.Node]) -> tuple[float | None, str | None]:
    """eps of the RMSNorm and which form wrote it: F.rms_norm decomposes to add.Scalar, `var + eps` is add.Tensor."""
    for node in chain:
        if node.op == "call_function" and node.target in (aten.add.Tensor, aten.add.Scalar):
            consts = [a for a in node.args if isinstance(a, float)]
            if consts:
                check_walked(node, "the RMSNorm's eps add")
                return consts[0], "functional" if node.target is aten.add.Scalar else "manual"
    return None, None


def _single_user(node: fx.Node, what: str) -> fx.Node:
    users = list(node.users)
    if len(users) != 1:
        names = ", ".join(u.name for u in users) or "nothing"
        raise Reject(f"{what} ({node.name}) is used by {names}; the fused ops need it used once, by the block")
    if users[0].op == "output":
        raise Reject(f"{what} ({node.name}) is a graph output")
    return users[0]


# -- shared side: the reduction, then the shared expert ---------------------------------------------
def _shared_reduction(cand: Candidate, s: fx.Node) -> fx.Node:
    """Classify the form from how the shared output reaches the add; returns the shared down mm."""
    if s.op == "call_function" and s.target is MM:
        cand.form = "local"
        check_walked(s, "the shared down-projection")
        return _only_used_by(s, cand.out, "shared expert output")
    if (why := other_matmul(s)) is not None:
        raise Reject(f"the shared expert's down-projection {s.name} ({target_name(s.target)}) {why}")
    if s.op != "call_function" or s.target is not c10d.wait_tensor.default:
        raise Reject(f"the add's other operand {s.name} ({s.target}) is neither a shared-expert matmul nor a waited collective")
    _only_used_by(s, cand.out, "reduced shared expert output")
    coll = s.args[0]
    form = COLLECTIVE_FORMS.get(getattr(coll, "target", None))
    if form is None:
        raise Reject(f"the shared output arrives through {coll.target}, not an all_reduce or reduce_scatter_tensor")
    _only_used_by(coll, s, "shared collective")
    check_walked(s, "the shared output's wait")
    check_walked(coll, "the shared output's collective")
    cand.form = form
    if form == "all_reduce":
        source, reduce_op, cand.group_name = coll.args[:3]
    else:
        source, reduce_op, world, cand.group_name = coll.args[:4]
        cand.world = int(world)
    if reduce_op != "sum":
        raise Reject(f"{coll.name} reduces with {reduce_op!r}; only 'sum' is the shared expert's reduction")
    if (why := other_matmul(source)) is not None:
        raise Reject(f"the shared expert's down-projection {source.name} ({target_name(source.target)}) {why}")
    if not (isinstance(source, fx.Node) and source.op == "call_function" and source.target is MM):
        raise Reject(f"{coll.name} reduces {source}, not the shared expert's down-projection matmul")
    check_walked(source, "the shared down-projection")
    return _only_used_by(source, coll, "shared expert output")


def _only_used_by(node: fx.Node, consumer: fx.Node, what: str) -> fx.Node:
    others = [u for u in node.users if u is not consumer]
    if others:
        raise Reject(f"{what} ({node.name}) also used by {', '.join(u.name for u in others)}")
    return node


def _shared_expert(cand: Candidate, config: FusionConfig, order) -> None:
    """Walk back from the shared down mm to the gate/up matmul(s) through the SiTU."""
    act = cand.shared_mm.args[0]
    if not isinstance(act, fx.Node):
        raise Reject(f"shared down-projection {cand.shared_mm.name} has no activation input")
    region: set[fx.Node] = set()
    mms: set[fx.Node] = set()
    stack = [act]
    while stack:
        node = stack.pop()
        if node in region or node in mms:
            continue
        if node.op == "call_function" and node.target is MM:
            check_walked(node, "the shared gate/up projection")
            mms.add(node)
            continue
        if (why := other_matmul(node)) is not None:
            raise Reject(f"the shared gate/up projection {node.name} ({target_name(node.target)}) {why}")
        if node.op != "call_function":
            raise Reject(f"shared activation reads {node.name} directly, not through the gate/up matmul(s)")
        region.add(node)
        if len(region) > config.max_walk_nodes:
            raise Reject(f"shared activation needs more than {config.max_walk_nodes} ops after the gate/up matmul(s)")
        stack.extend(node.all_input_nodes)
    if len(mms) not in (1, 2):
        raise Reject(f"shared activation is computed from {len(mms)} matmuls; expected 1 (merged gate/up) or 2")
    for node in sorted(region | mms, key=order.__getitem__):
        inside = region | {cand.shared_mm}
        others = [u for u in node.users if u not in inside]
        if others:
            what = "shared gate/up projection" if node in mms else "shared activation intermediate"
            raise Reject(f"{what} {node.name} also used by {', '.join(u.name for u in others)}")
    inputs = {mm.args[0] for mm in mms}
    if len(inputs) != 1:
        raise Reject("the shared gate and up matmuls read different inputs")
    cand.x_s = next(iter(inputs))
    cand.gate_up = "merged" if len(mms) == 1 else "split"
    cand.gate_up_mms = tuple(sorted(mms, key=order.__getitem__))
