"""Matmuls whose rows Inductor padded, shown to the walker and the patterns as plain matmuls.

Inductor's pad_mm pass (a joint-graph pass, so it runs before this post-grad pass) pads a matmul's
rows when its benchmark says the padded shape is faster, and slices the result back:

    p = constant_pad_nd(a, [0, 0, 0, k]);  y = mm(p, w);  s = slice(y, 0, 0, -k)

On the H200 it did so for the shared down-projection of the Kimi K3 block at M = 4 (4 -> 8 rows),
which left the block unfused ("the add's other operand slice_tensor ... is neither a shared-expert
matmul nor a waited collective"). `expose` replaces each such chain by a plain `mm(a, w)` (a chain left
in place would count as another reader of `a` to the walker); the walker and the pattern matcher then
see the block's usual shape. `settle` keeps that form only where a fused block swallowed the plain
matmul and rebuilds the padded chain, with the same arguments, everywhere else, so no other matmul
changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

aten = torch.ops.aten
MM = aten.mm.default


@dataclass(frozen=True)
class RowPaddedMatmul:
    """A removed pad -> mm -> slice chain: what rebuilds it, and the plain mm(a, w) now in its place."""

    plain: fx.Node  # mm(a, w): its arguments follow any rewrite of a or w
    pad_args: tuple  # after the padded operand
    pad_kwargs: dict
    pad_meta: dict
    mm_meta: dict
    slice_args: tuple  # after the mm operand
    slice_meta: dict


def _call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _rows(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() == 2 else None


def _padded_rows(pad: fx.Node) -> int | None:
    """k for constant_pad_nd(a, [0, 0, 0, k]) with value 0 on a 2-D a (rows appended, nothing else)."""
    if not _call(pad, aten.constant_pad_nd.default):
        return None
    widths = list(pad.args[1])
    value = pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0)
    if len(widths) != 4 or widths[:3] != [0, 0, 0] or widths[3] <= 0 or value != 0:
        return None
    return int(widths[3])


def _matches(row_slice: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(a, pad, mm) when row_slice = slice(mm(constant_pad_nd(a, rows only), w), 0, 0, rows of a)."""
    if not _call(row_slice, aten.slice.Tensor) or len(row_slice.args) < 4:
        return None
    mm, dim, start, end = row_slice.args[:4]
    step = row_slice.args[4] if len(row_slice.args) > 4 else 1
    if not _call(mm, MM) or len(mm.users) != 1 or dim != 0 or start != 0 or step != 1:
        return None
    pad = mm.args[0]
    k = _padded_rows(pad)
    if k is None or len(pad.users) != 1:
        return None
    a = pad.args[0]
    rows = _rows(a) if isinstance(a, fx.Node) else None
    if rows is None or end not in (-k, rows):
        return None
    return a, pad, mm


def expose(graph: fx.Graph) -> list[RowPaddedMatmul]:
    """Replace every row-padded matmul chain by mm(a, w); returns what `settle` needs to rebuild them."""
    exposed = []
    for row_slice in list(graph.nodes):
        found = _matches(row_slice)
        if found is None:
            continue
        a, pad, mm = found
        with graph.inserting_before(row_slice):
            plain = graph.call_function(MM, (a, mm.args[1]))
        plain.meta.update(row_slice.meta)
        row_slice.replace_all_uses_with(plain)
        exposed.append(RowPaddedMatmul(plain, tuple(pad.args[1:]), dict(pad.kwargs), dict(pad.meta), dict(mm.meta),
                                       tuple(row_slice.args[1:]), dict(row_slice.meta)))
        for node in (row_slice, mm, pad):
            graph.erase_node(node)
    return exposed


def settle(graph: fx.Graph, exposed: list[RowPaddedMatmul]) -> int:
    """After the rewrite: rebuild the padded chain wherever the plain matmul is still in the graph (no
    fused op took it). Returns how many matmuls a fused block took unpadded."""
    live = set(graph.nodes)
    fused = 0
    for chain in exposed:
        if chain.plain not in live:
            fused += 1
            continue
        with graph.inserting_before(chain.plain):
            a, w = chain.plain.args
            pad = graph.call_function(aten.constant_pad_nd.default, (a, *chain.pad_args), chain.pad_kwargs)
            mm = graph.call_function(MM, (pad, w))
            row_slice = graph.call_function(aten.slice.Tensor, (mm, *chain.slice_args))
        for node, meta in ((pad, chain.pad_meta), (mm, chain.mm_meta), (row_slice, chain.slice_meta)):
            node.meta.update(meta)
        chain.plain.replace_all_uses_with(row_slice)
        graph.erase_node(chain.plain)
    return fused
