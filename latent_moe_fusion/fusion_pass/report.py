"""What one run of the fusion pass did: blocks rewritten, candidates left alone and why."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

from .node_args import target_name


@dataclass(frozen=True)
class MatchedBlock:
    where: str  # "routed_experts_1 -> add_7": the block's first and last node in the post-grad graph
    form: str  # local | all_reduce | sequence_parallel
    mode: str  # the fused layout: local | hidden_scatter | token_publish
    variant: str  # gate/up form, RMSNorm form, dtype, weight format
    group_name: str | None


@dataclass(frozen=True)
class MatchedRouting:
    where: str  # "sigmoid -> topk -> mul, where": the router chain replaced by lmf::noaux_tc_route
    top_k: int
    localized: bool  # the EP share (ids - first, -1 outside) folded into the op
    backend: str
    # "mm + mm_1 [side_stream]": the gate GEMM and the down-projection that went into lmf::route_and_project
    # with the route (router_overlap.py), or None and the reason in beside_reason
    beside: str | None = None
    beside_reason: str | None = None
    # the fused block's producer went into the op too: lmf::route_and_produce (shared expert first)
    with_producer: bool = False
    # why an EP share after the ids (ids - first, -1 outside) was left to Inductor instead of folded in
    share_reason: str | None = None
    # with_producer and the SP block's all-gather of the tokens went in too: lmf::route_gather_and_produce (the gather
    # beside the router and the down-projection); or False, and for an SP block why the gather stays before the op
    gathers_tokens: bool = False
    gather_reason: str | None = None


@dataclass
class FusionReport:
    matched: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (where, reason)
    blocks: list[MatchedBlock] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: Counter = field(default_factory=Counter)  # call_function target name -> count
    ops_after: Counter = field(default_factory=Counter)
    routings: list[MatchedRouting] = field(default_factory=list)  # router chains rewritten
    routing_rejected: list[tuple[str, str]] = field(default_factory=list)  # (topk node, reason)
    unpadded_matmuls: int = 0  # pad_mm-padded matmuls inside fused blocks, see mm_padding.py
    # True: Inductor's FX graph cache served the graph and the pass did not run; this is the report of the
    # compile that made the cached graph (cache_record.py)
    from_cache: bool = False

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["blocks"] = [asdict(b) for b in self.blocks]
        data["routings"] = [asdict(r) for r in self.routings]
        data["ops_before"], data["ops_after"] = dict(self.ops_before), dict(self.ops_after)  # asdict garbles a Counter
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> FusionReport:
        data = json.loads(text)
        return cls(
            matched=data["matched"],
            rejected=[tuple(pair) for pair in data["rejected"]],
            blocks=[MatchedBlock(**b) for b in data["blocks"]],
            nodes_before=data["nodes_before"],
            nodes_after=data["nodes_after"],
            ops_before=Counter(data["ops_before"]),
            ops_after=Counter(data["ops_after"]),
            routings=[MatchedRouting(**r) for r in data["routings"]],
            routing_rejected=[tuple(pair) for pair in data["routing_rejected"]],
            unpadded_matmuls=data["unpadded_matmuls"],
            from_cache=data["from_cache"],
        )

    def ops_removed(self) -> Counter:
        return self.ops_before - self.ops_after

    def ops_added(self) -> Counter:
        return self.ops_after - self.ops_before

    def summary(self) -> str:
        source = " (served from Inductor's FX graph cache: the pass did not run; its report of the cached compile)"
        lines = [f"latent-moe fusion: {self.matched} block(s) rewritten, {len(self.rejected)} left alone; "
                 f"post-grad nodes {self.nodes_before} -> {self.nodes_after}"
                 + (f"; {self.unpadded_matmuls} padded matmul(s) fused" if self.unpadded_matmuls else "")
                 + (source if self.from_cache else "")]
        lines += [f"  fused    {b.where}: {b.form} (mode {b.mode}, group {b.group_name}) [{b.variant}]" for b in self.blocks]
        lines += [f"  rejected {where}: {reason}" for where, reason in self.rejected]
        lines += [f"  router   {r.where}: lmf::noaux_tc_route top_k={r.top_k}"
                  f"{' with the EP share' if r.localized else ''} [{r.backend}]"
                  + (f"; with its GEMM beside the down-projection, the producer and the SP tokens' all-gather in "
                     f"lmf::route_gather_and_produce: {r.beside}" if r.beside and r.gathers_tokens
                     else f"; with its GEMM beside the down-projection and the producer in lmf::route_and_produce: "
                     f"{r.beside}" if r.beside and r.with_producer
                     else f"; with its GEMM beside the down-projection in lmf::route_and_project: {r.beside}" if r.beside
                     else f"; not beside the down-projection: {r.beside_reason}" if r.beside_reason else "")
                  + (f"; the SP tokens gathered before the op: {r.gather_reason}" if r.gather_reason else "")
                  + (f"; EP share not folded in: {r.share_reason}" if r.share_reason else "")
                  for r in self.routings]
        lines += [f"  router left alone {where}: {reason}" for where, reason in self.routing_rejected]
        if self.matched or self.routings:
            removed = ", ".join(f"{name} x{n}" for name, n in sorted(self.ops_removed().items()))
            added = ", ".join(f"{name} x{n}" for name, n in sorted(self.ops_added().items()))
            lines += [f"  ops removed: {removed or '-'}", f"  ops added:   {added or '-'}"]
        return "\n".join(lines)


def op_counts(graph) -> Counter:
    """call_function nodes by target name (aten.mm.default, lmf.latent_tail.default, ...)."""
    counts: Counter = Counter()
    for node in graph.nodes:
        if node.op == "call_function":
            counts[target_name(node.target)] += 1
    return counts
