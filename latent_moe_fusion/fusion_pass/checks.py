"""Can the fused ops serve a structurally sound candidate? Sizes, dtypes, topology, backends.

Inputs are the graph's fake values (shapes, dtypes, devices: the same on every rank), the pass
configuration and the capabilities agreed across ranks when the pass was built. A check that cannot
decide (symbolic size it cannot prove, a backend probe that raises) rejects: fail closed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..ops.common.backends import backends_for
from ..ops.common.fragment_layouts import fragment_shape, group_size
from ..patterns import FORMS
from .candidates import Candidate
from .capabilities import Capabilities
from .config import FusionConfig
from .reject import Reject


def _val(node: Any, what: str) -> torch.Tensor:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise Reject(f"{what} ({getattr(node, 'name', node)}) carries no tensor metadata to check")
    return val


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _known_equal(a, b) -> bool:
    return statically_known_true(a == b)


def check_candidate(cand: Candidate, config: FusionConfig, caps: Capabilities) -> dict[str, str]:
    """The backend that will serve each fused op; raises Reject with the reason if the block cannot be fused."""
    if cand.form not in config.forms:
        raise Reject(f"form {cand.form!r} is not enabled (FusionConfig.forms = {config.forms})")
    if cand.gate_up not in config.gate_up_forms:
        raise Reject(f"{cand.gate_up} gate/up is not enabled (FusionConfig.gate_up_forms = {config.gate_up_forms})")
    routed_args = cand.routed.args
    if len(routed_args) != 10:
        raise Reject(f"{cand.routed.name} has {len(routed_args)} positional arguments, expected the 10 of lmf::routed_experts")
    weight_format = routed_args[7]
    if weight_format not in config.weight_formats:
        raise Reject(f"weight format {weight_format!r} is not enabled (FusionConfig.weight_formats = {config.weight_formats})")

    y = _val(cand.routed, "routed-expert output")
    dtype = _dtype_name(y.dtype)
    if dtype not in config.dtypes:
        raise Reject(f"activation dtype {dtype} is not supported (fused ops take {', '.join(config.dtypes)})")
    for node, what in ((cand.x_s, "shared expert input x_s"), (cand.shared_mm, "shared expert output"),
                       (cand.up_mm, "routed up-projection output"), (cand.out, "block output")):
        other = _val(node, what)
        if other.dtype != y.dtype:
            raise Reject(f"{what} ({node.name}) is {_dtype_name(other.dtype)} while the routed path is {dtype}; "
                         "the producer takes one activation dtype")
        if other.device != y.device:
            raise Reject(f"{what} ({node.name}) is on {other.device}, the routed path on {y.device}")
        if other.dim() != 2:
            raise Reject(f"{what} ({node.name}) is {other.dim()}-D; the fused ops take [tokens, features]")

    world = cand.world = _world(cand)
    tokens, hidden = _val(cand.out, "block output").shape
    x_s = _val(cand.x_s, "shared expert input x_s")
    rows = tokens * world if cand.form == "sequence_parallel" else tokens
    if not _known_equal(x_s.shape[0], rows):
        raise Reject(f"x_s has {x_s.shape[0]} rows, {cand.form} with R = {world} needs {rows}")
    if not _known_equal(x_s.shape[1], hidden):
        raise Reject(f"x_s has {x_s.shape[1]} features but the block output has {hidden}")
    if not _known_equal(hidden % world, 0):
        raise Reject(f"hidden {hidden} is not divisible by R = {world} ({FORMS[cand.form].mode} needs H/R columns per rank)")
    return _check_backends(cand, config, caps, world, tokens, hidden)


def _world(cand: Candidate) -> int:
    if cand.form == "local":
        return 1
    try:
        world = group_size(cand.group_name)
    except Exception as exc:
        raise Reject(f"process group {cand.group_name!r} cannot be resolved here ({exc})") from exc
    if cand.form == "sequence_parallel" and world != cand.world:
        raise Reject(f"reduce_scatter over {cand.world} ranks but group {cand.group_name!r} has {world}")
    if world < 2:
        raise Reject(f"group {cand.group_name!r} has one rank: nothing to fuse across ranks")
    return world


def _check_backends(
    cand: Candidate, config: FusionConfig, caps: Capabilities, world: int, tokens, hidden
) -> dict[str, str]:
    """Some backend of each fused op, available on every rank, must accept these arguments."""
    y = _val(cand.routed, "routed-expert output")
    device = y.device.type
    mode = FORMS[cand.form].mode
    fake_mode = getattr(y, "fake_mode", None)
    if fake_mode is None:
        raise Reject("the graph has no fake tensors to check backend support with")
    args = [_val(a, f"routed_experts argument {i}") if isinstance(a, fx.Node) else a for i, a in enumerate(cand.routed.args)]
    latent = y.shape[1]
    inter_s = _val(cand.shared_mm.args[0], "shared activation").shape[1]
    with fake_mode:
        def empty(*shape):
            return torch.empty(shape, dtype=y.dtype, device=y.device)

        producer_args = (*args, empty(latent), cand.eps if cand.eps is not None else 1e-6,
                         _val(cand.x_s, "x_s"), empty(inter_s, hidden), empty(inter_s, hidden), empty(hidden, inter_s),
                         mode, cand.group_name)
        tail_args = (empty(tokens, latent), empty(hidden, latent), empty(*fragment_shape(mode, tokens, hidden, world)),
                     mode, cand.group_name)
        return {
            op: serving_backend(op, device, op_args, config, caps)
            for op, op_args in (("moe_shared_producer", producer_args), ("latent_tail", tail_args))
        }


def serving_backend(op: str, device: str, args: tuple, config: FusionConfig, caps: Capabilities) -> str:
    reasons = []
    for backend in backends_for(op):
        if (op, backend.name) not in caps.backends:
            reasons.append(f"{backend.name}: not available on every rank")
        elif device not in backend.device_types:
            reasons.append(f"{backend.name}: runs on {'/'.join(backend.device_types)}")
        elif backend.name == "reference" and device not in config.reference_backend_devices:
            reasons.append(f"reference: not used for fusion on {device} (FusionConfig.reference_backend_devices)")
        else:
            try:
                reason = backend.supports(*args)
            except Exception as exc:
                reason = f"support check raised {type(exc).__name__}: {exc}"
            if reason is None:
                return backend.name
            reasons.append(f"{backend.name}: {reason}")
    raise Reject(f"no backend of lmf::{op} serves this block on {device} ({'; '.join(reasons) or 'none registered'})")
