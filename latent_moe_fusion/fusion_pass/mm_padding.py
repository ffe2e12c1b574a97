"""Matmuls that Inductor padded, shown to the walker and the patterns as plain matmuls.

Inductor's pad_mm pass (a joint-graph pass, so it runs before this post-grad pass) pads a matmul to
aligned sizes when its benchmark says the padded shape is faster, and slices the result back:

    a' = constant_pad_nd(a, [0, kp, 0, mp])   b' = constant_pad_nd(b, [0, np, 0, kp])
    y  = mm(a', b')[:-mp, :][:, :-np]          (each pad or slice only where its amount is > 0)

On the H200 it padded the rows (mp) of the Kimi K3 block's shared down-projection at M = 4 (4 -> 8),
which left the block unfused ("the add's other operand slice_tensor ... is neither a shared-expert
matmul nor a waited collective"). `expose` replaces each such chain by a plain `mm(a, b)` (a chain left
in place would count as another reader of `a` to the walker); the walker and the pattern matcher then
see the block's usual shape. `settle` keeps that form only where a fused block swallowed the plain
matmul and rebuilds the padded chain, with the same arguments, everywhere else, so no other matmul
changes. Zero rows and columns added to K contribute exact zeros, and padded rows and columns of the
output are sliced away, so the plain matmul computes the same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from .node_args import WALK_READS, stray_arguments

aten = torch.ops.aten
MM = aten.mm.default
PAD = aten.constant_pad_nd.default
SLICE = aten.slice.Tensor


@dataclass(frozen=True)
class _Operand:
    index: int  # 0: a, 1: b (read from the plain matmul's current arguments when rebuilding)


@dataclass(frozen=True)
class _Earlier:
    index: int  # output of the chain's index-th rebuilt node


@dataclass(frozen=True)
class _Step:
    target: Any
    args: tuple
    kwargs: dict
    meta: dict


@dataclass(frozen=True)
class PaddedMatmul:
    """A removed pad(s) -> mm -> slice(s) chain: how to rebuild it, and the plain mm(a, b) in its place."""

    plain: fx.Node  # mm(a, b): its arguments follow any rewrite of a or b
    steps: tuple[_Step, ...]  # the chain in graph order


def _call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _size(node: fx.Node, dim: int) -> int | None:
    val = node.meta.get("val")
    return int(val.shape[dim]) if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _unpad(operand: fx.Node, mm: fx.Node) -> tuple[fx.Node, int, int]:
    """(unpadded tensor, columns appended, rows appended) of a matmul operand; (operand, 0, 0) if it is
    not a zero constant_pad_nd read only by this matmul."""
    if not _call(operand, PAD) or len(operand.users) != 1 or mm not in operand.users:
        return operand, 0, 0
    widths = list(operand.args[1])
    value = operand.args[2] if len(operand.args) > 2 else operand.kwargs.get("value", 0)
    if len(widths) != 4 or widths[0] != 0 or widths[2] != 0 or min(widths) < 0 or value != 0:
        return operand, 0, 0
    return operand.args[0], int(widths[1]), int(widths[3])


def _trim(node: fx.Node, dim: int, amount: int, kept: int | None) -> fx.Node | None:
    """node's only user when it is node[..., :-amount] along dim (or :kept), else None."""
    users = list(node.users)
    if len(users) != 1 or not _call(users[0], SLICE) or len(users[0].args) < 4:
        return None
    row_slice = users[0]
    _, sdim, start, end = row_slice.args[:4]
    step = row_slice.args[4] if len(row_slice.args) > 4 else 1
    if sdim != dim or start != 0 or step != 1 or end not in (-amount, kept):
        return None
    if stray_arguments(row_slice, WALK_READS[SLICE]):
        return None
    return row_slice


def _chain(mm: fx.Node) -> tuple[list[fx.Node], fx.Node, fx.Node, fx.Node] | None:
    """(chain nodes in graph order, a, b, last node) when mm is the centre of a pad_mm chain."""
    if not _call(mm, MM):
        return None
    a, kp_a, mp = _unpad(mm.args[0], mm)
    b, np_, kp_b = _unpad(mm.args[1], mm)
    if kp_a != kp_b or not (kp_a or mp or np_):
        return None
    nodes = [n for n in (mm.args[0], mm.args[1]) if n is not a and n is not b] + [mm]
    if any(stray_arguments(n, WALK_READS[n.target]) for n in nodes):
        return None  # an argument the plain matmul would drop: the chain stays as it is
    last = mm
    for dim, amount, operand in ((0, mp, a), (1, np_, b)):
        if amount:
            trimmed = _trim(last, dim, amount, _size(operand, dim))
            if trimmed is None:
                return None
            nodes.append(trimmed)
            last = trimmed
    return nodes, a, b, last


def _encode(value, a: fx.Node, b: fx.Node, index: dict[fx.Node, int]):
    if isinstance(value, fx.Node):
        if value in index:
            return _Earlier(index[value])
        return _Operand(0 if value is a else 1)
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v, a, b, index) for v in value)
    return value


def _decode(value, operands: tuple, built: list[fx.Node]):
    if isinstance(value, _Operand):
        return operands[value.index]
    if isinstance(value, _Earlier):
        return built[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v, operands, built) for v in value)
    return value


def expose(graph: fx.Graph) -> list[PaddedMatmul]:
    """Replace every pad_mm chain by mm(a, b); returns what `settle` needs to rebuild them."""
    exposed = []
    for mm in list(graph.nodes):
        found = _chain(mm)
        if found is None:
            continue
        nodes, a, b, last = found
        index = {node: i for i, node in enumerate(nodes)}
        steps = tuple(_Step(n.target, _encode(n.args, a, b, index), _encode(dict(n.kwargs), a, b, index),
                            dict(n.meta)) for n in nodes)
        with graph.inserting_before(last):
            plain = graph.call_function(MM, (a, b))
        plain.meta.update(last.meta)
        last.replace_all_uses_with(plain)
        for node in reversed(nodes):
            graph.erase_node(node)
        exposed.append(PaddedMatmul(plain, steps))
    return exposed


def settle(graph: fx.Graph, exposed: list[PaddedMatmul]) -> int:
    """After the rewrite: rebuild the padded chain wherever the plain matmul is still in the graph (no
    fused op took it). Returns how many matmuls a fused block took unpadded."""
    live = set(graph.nodes)
    fused = 0
    for chain in exposed:
        if chain.plain not in live:
            fused += 1
            continue
        operands = tuple(chain.plain.args)
        built: list[fx.Node] = []
        with graph.inserting_before(chain.plain):
            for step in chain.steps:
                node = graph.call_function(step.target, _decode(step.args, operands, built),
                                           _decode(step.kwargs, operands, built))
                node.meta.update(step.meta)
                built.append(node)
        chain.plain.replace_all_uses_with(built[-1])
        graph.erase_node(chain.plain)
    return fused
