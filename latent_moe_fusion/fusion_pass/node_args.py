"""Every argument of every node the pass consumes is accounted for: read and checked, or at its default.

Inductor's pattern matcher compares only the keyword arguments its pattern names and drops the others
(`torch.add(u, s, alpha=0.5)` matches the pattern `u + s`), and a walk reads only the arguments it needs.
A node that carries any other argument computes something else, and fusing it would change the numbers
without a word. So each consumed node is checked here against what its reader pins: every other argument
of its schema must be absent or equal to the schema's default, and a node whose target has no schema may
carry no keyword argument at all. Anything else leaves the block, router or matmul alone, with a reason
that names the node and the argument.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from .reject import Reject

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

# The arguments the walks (candidates.py, routing.py, router_overlap.py, mm_padding.py) read and check, per
# target they consume. A target missing here is refused: the walks consume nothing they have not declared.
WALK_READS: dict[Any, tuple[str, ...]] = {
    aten.add.Tensor: ("self", "other"),
    aten.add.Scalar: ("self", "other"),
    aten.sub.Tensor: ("self", "other"),
    aten.mul.Tensor: ("self", "other"),
    aten.div.Tensor: ("self", "other"),
    aten.sigmoid.default: ("self",),
    aten.topk.default: ("self", "k", "dim", "largest", "sorted"),
    aten.gather.default: ("self", "dim", "index"),
    aten.sum.dim_IntList: ("self", "dim", "keepdim"),
    aten.ge.Scalar: ("self", "other"),
    aten.lt.Scalar: ("self", "other"),
    aten.bitwise_and.Tensor: ("self", "other"),
    aten.where.self: ("condition", "self", "other"),
    # the -1 fill of the EP share: its value, dtype and shape are checked through the where it feeds
    aten.full.default: ("size", "fill_value", "dtype", "layout", "device", "pin_memory"),
    prims.convert_element_type.default: ("a", "dtype"),
    aten.mm.default: ("self", "mat2"),
    aten.mm.dtype: ("self", "mat2", "out_dtype"),
    aten.permute.default: ("self", "dims"),
    aten.constant_pad_nd.default: ("self", "pad", "value"),
    aten.slice.Tensor: ("self", "dim", "start", "end", "step"),
    c10d.all_reduce.default: ("input", "reduce_op", "group_name"),
    c10d.reduce_scatter_tensor.default: ("input", "reduce_op", "group_size", "group_name"),
    c10d.all_gather_into_tensor.default: ("input", "group_size", "group_name"),
    c10d.wait_tensor.default: ("tensor",),
    operator.getitem: (),  # positional (tuple, index) only
}


def target_name(target: Any) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)  # "aten.add.Tensor", "mkl._mkl_linear"
    return getattr(target, "__name__", str(target))


def _equal(value: Any, default: Any) -> bool:
    if isinstance(value, fx.Node):
        return False  # a computed value is never a schema default
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default  # True == 1 in Python, not for a schema
    try:
        return bool(value == default)
    except Exception:  # values that do not compare (tensors): not the default
        return False


def stray_arguments(node: fx.Node, pinned: Iterable[str]) -> list[tuple[str, Any]]:
    """(name, value) of each argument of `node` that is neither in `pinned` nor absent or at its default."""
    pinned = set(pinned)
    schema = getattr(node.target, "_schema", None)
    if schema is None:  # a Python callable: its positional arguments are what the reader reads
        return [(k, v) for k, v in node.kwargs.items() if k not in pinned]
    arguments = schema.arguments
    given: dict[str, Any] = {}
    stray: list[tuple[str, Any]] = []
    for i, value in enumerate(node.args):
        if i < len(arguments):
            given[arguments[i].name] = value
        else:
            stray.append((f"argument {i}", value))
    known = {a.name for a in arguments}
    for name, value in node.kwargs.items():
        if name in known:
            given[name] = value
        else:
            stray.append((name, value))
    for arg in arguments:
        if arg.name in pinned or arg.name not in given:
            continue
        value = given[arg.name]
        if not arg.has_default_value() or not _equal(value, arg.default_value):
            stray.append((arg.name, value))
    return stray


def describe_stray(node: fx.Node, stray: list[tuple[str, Any]], what: str) -> str:
    def show(value: Any) -> str:
        return value.name if isinstance(value, fx.Node) else repr(value)

    args = ", ".join(f"{name}={show(value)}" for name, value in stray)
    return (f"{what} {node.name} ({target_name(node.target)}) has {args}, which the fused op does not compute: "
            "every argument it does not read must be at its default")


def check_walked(node: fx.Node, what: str) -> None:
    """Raise Reject unless `node` carries only what the walks read of its target (WALK_READS)."""
    if node.op != "call_function":
        raise Reject(f"{what} {node.name} is a {node.op} node, not a call the pass reads")
    if node.target not in WALK_READS:
        raise Reject(f"{what} {node.name} is {target_name(node.target)}, which the pass does not read")
    stray = stray_arguments(node, WALK_READS[node.target])
    if stray:
        raise Reject(describe_stray(node, stray, what))


def check_all_walked(nodes: Iterable[fx.Node], what: str) -> None:
    for node in nodes:
        check_walked(node, what)
