"""Registration of the PatternSpecs with Inductor's pattern matcher, and the gate every match passes.

Tracing a pattern costs about a second, so each spec's PatternMatcherPass is built once per process
and shared by all pass instances. The matcher only proposes: its extra_check accepts a match only
if the running pass approved that block (a contextvar holds the approvals of the graph being
rewritten), so a pattern can never fire outside the pass or on a candidate the checks rejected.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
from torch import fx
from torch._inductor.pattern_matcher import (
    Match,
    PatternMatcherPass,
    _TargetArgsExpr,
    fwd_only,
    register_replacement,
)
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..patterns import PatternSpec
from ..patterns.spec import SCALAR_EXAMPLES
from .candidates import ROUTED, Candidate
from .node_args import describe_stray, stray_arguments

_APPROVED: contextvars.ContextVar[dict[fx.Node, Candidate] | None] = contextvars.ContextVar(
    "latent_moe_fusion_approved", default=None
)


@contextlib.contextmanager
def approved(candidates: dict[fx.Node, Candidate]) -> Iterator[None]:
    token = _APPROVED.set(candidates)
    try:
        yield
    finally:
        _APPROVED.reset(token)


def _gate(spec: PatternSpec):
    def extra_check(match: Match) -> bool:
        candidates = _APPROVED.get()
        if candidates is None:
            return False
        routed = next((n for n in match.nodes if getattr(n, "target", None) is ROUTED), None)
        cand = candidates.get(routed)
        if cand is None or cand.form != spec.form.name or cand.gate_up != spec.gate_up:
            return False
        if cand.out not in match.nodes:
            return False
        reason = _stray_arguments(match) or _ops_refuse(spec, match)
        if reason is not None:
            cand.gate_reason = reason
            return False
        cand.spec = spec
        return True

    return extra_check


def _stray_arguments(match: Match) -> str | None:
    """Inductor's matcher compares only the keyword arguments a pattern names: every matched node must carry
    nothing else but defaults (node_args.py), or the replacement would drop what it carries."""
    for pattern, node in match.ctx.pattern_to_node.items():
        if not isinstance(pattern, _TargetArgsExpr) or not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        pinned = set(names[: len(pattern.args)]) | set(pattern.kwargs)
        stray = stray_arguments(node, pinned)
        if stray:
            return describe_stray(node, stray, "matched node")
    return None


def _ops_refuse(spec: PatternSpec, match: Match) -> str | None:
    """Run the replacement on the match's fake values: the fused ops' own checks (dtypes, shapes,
    strides) then refuse here, with their message, instead of failing the compile mid-rewrite."""
    values = {}
    for name in spec.arg_names():
        arg = match.kwargs.get(name, _MISSING)
        if arg is _MISSING:
            arg = _scalar_from_graph(name, match)
        values[name] = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    fake = next((v for v in values.values() if isinstance(v, torch.Tensor)), None)
    fake_mode = getattr(fake, "fake_mode", None)
    if fake_mode is None:
        return "the matched arguments carry no fake tensors to check the fused ops with"
    try:
        with fake_mode:
            spec.replace(values)
    except Exception as exc:
        return f"the fused ops refuse the matched arguments ({type(exc).__name__}: {exc})"
    return None


_MISSING = object()
# Positions of the SiTU betas in lmf::routed_experts' schema.
_ROUTED_SCALAR_ARG = {"beta": 8, "lin_beta": 9}


def _scalar_from_graph(name: str, match: Match):
    """torch 2.11 leaves the scalar_workaround arguments (eps, beta, lin_beta) out of Match.kwargs at
    extra_check time (2.13 has them; seen on the H200 image). The betas are read off the matched
    routed op; eps only has to be a valid float for this shape/dtype check (the op re-checks it)."""
    if name in _ROUTED_SCALAR_ARG:
        routed = next(n for n in match.nodes if getattr(n, "target", None) is ROUTED)
        return routed.args[_ROUTED_SCALAR_ARG[name]]
    if name in SCALAR_EXAMPLES:
        return SCALAR_EXAMPLES[name]
    return None


@functools.cache
def matcher_for(spec: PatternSpec) -> PatternMatcherPass:
    """A PatternMatcherPass holding this one spec (traced once per process)."""
    matcher = PatternMatcherPass()
    # Patterns are traced on meta tensors: no data, no process group, outside the compile's fake mode.
    with unset_fake_temporarily():
        register_replacement(
            spec.search_fn(),
            spec.replace_fn(),
            spec.example_inputs(),
            fwd_only,
            matcher,
            extra_check=_gate(spec),
            scalar_workaround=dict(SCALAR_EXAMPLES),
        )
    return matcher
