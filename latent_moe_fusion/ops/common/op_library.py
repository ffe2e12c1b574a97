"""torch.library registration of the lmf ops: schema, fake (meta) impl, backend dispatch.

All three ops are functional (return outputs, mutate nothing). The real impl validates the
arguments, picks a backend (see backends.py) and runs it; the fake impl validates and returns
empty tensors of the right shape so that torch.compile catches bad arguments at trace time.

The ops are defined with `torch.library.Library` (schema, CPU and CUDA kernels, fake impl) rather than
`torch.library.custom_op`, whose Python autograd and aliasing-check layers run on every call: on the
H200's host the producer's minimum host time per call is 50-80 us lower this way (bench/op_host_time.py),
time a prefill forward outside CUDA graphs pays as GPU idle time. The ops are not differentiable:
autograd passes over them (their outputs never require grad), so a backward through one fails loudly.
"""

from __future__ import annotations

import functools

import torch

from . import deepgemm, reference, triton_kernels  # noqa: F401  (importing registers the backends)
from .backends import select_backend
from .layouts import fragment_shape
from .validation import (
    check_ids,
    check_mode_and_group,
    check_positive,
    check_shape,
    check_tensor,
    validate_producer_layout,
    validate_routed,
    validate_shared,
    validate_tail,
)

try:  # CuTe DSL backends: registering them imports no cutlass, and must never break importing the package
    from . import cute as _cute  # noqa: F401
except Exception as _exc:  # pragma: no cover - a broken optional install
    import warnings

    warnings.warn(f"latent_moe_fusion: CuTe DSL backends not registered ({_exc})", stacklevel=1)


_LIB = torch.library.Library("lmf", "DEF")  # module-level: the ops live as long as the process


def _define(schema: str, impl, fake) -> torch._ops.OpOverloadPacket:
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))

    @functools.wraps(impl)
    def kernel(*args):
        # Autograd falls through to here: run below it, so that the torch ops of the reference backend
        # record no graph either (every backend's outputs then equally never require grad).
        with torch._C._AutoDispatchBelowAutograd():
            return impl(*args)

    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    _LIB.impl(name, torch.library.fallthrough_kernel, "Autograd")  # not differentiable (module docstring)
    torch.library.register_fake(f"lmf::{name}", fake, lib=_LIB)
    return getattr(torch.ops.lmf, name)


def _run_routed_backend(op: str, topk_ids: torch.Tensor, num_experts: int, args: tuple):
    """Select the backend and run it, with the id range check finished after its launches where the
    backend's kernels allow it (validation.DeferredIdCheck)."""
    backend = select_backend(op, args[0].device.type, *args)
    pending = check_ids(op, topk_ids, num_experts, defer=backend.bad_ids_safe)
    out = backend.fn(*args)
    if pending is not None:
        pending.finish()
    return out


def _validate_producer(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name, ids: bool = True, op: str = "moe_shared_producer",
) -> tuple[int, int, int, int]:
    """Returns (M, H, R, E). op: the op named in errors."""
    num_experts, _ = validate_routed(op, z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format,
                                     beta, lin_beta, ids=ids)
    check_tensor(op, "rms_weight", rms_weight, ndim=1, dtypes=(z.dtype, torch.float32), device=z.device)
    check_shape(op, "rms_weight", rms_weight, (z.shape[1],), "[L] with L = z.shape[1]")
    check_positive(op, "eps", eps)
    hidden = validate_shared(op, x_s, w1_s, w3_s, w2_s, z.dtype, z.device)
    world = check_mode_and_group(op, mode, group_name)
    validate_producer_layout(op, z.shape[0], x_s, mode, world, group_name)
    return z.shape[0], hidden, world, num_experts


def _routed_experts(
    z: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    weight_format: str,
    beta: float,
    lin_beta: float,
) -> torch.Tensor:
    """Routed experts in the latent space: y [M, L] in z.dtype (DESIGN.md section 2)."""
    args = (z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta)
    num_experts, _ = validate_routed("routed_experts", *args, ids=False)
    return _run_routed_backend("routed_experts", topk_ids, num_experts, args)


def _routed_experts_fake(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta):
    validate_routed("routed_experts", z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta)
    return z.new_empty(z.shape)


routed_experts = _define(
    "routed_experts(Tensor z, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, Tensor? w13_scale, "
    "Tensor? w2_scale, str weight_format, float beta, float lin_beta) -> Tensor",
    _routed_experts, _routed_experts_fake,
)


def _moe_shared_producer(
    z: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    weight_format: str,
    beta: float,
    lin_beta: float,
    rms_weight: torch.Tensor,
    eps: float,
    x_s: torch.Tensor,
    w1_s: torch.Tensor,
    w3_s: torch.Tensor,
    w2_s: torch.Tensor,
    mode: str,
    group_name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y_n [M, L], ws): normalised routed output and this rank's shared fragments in `mode`'s layout."""
    args = (z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
            rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name)
    *_, num_experts = _validate_producer(*args, ids=False)
    return _run_routed_backend("moe_shared_producer", topk_ids, num_experts, args)


def _moe_shared_producer_fake(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name=None,
):
    m, hidden, world, _ = _validate_producer(
        z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
        rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name,
    )
    return z.new_empty(z.shape), x_s.new_empty(fragment_shape(mode, m, hidden, world))


moe_shared_producer = _define(
    "moe_shared_producer(Tensor z, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, Tensor? w13_scale, "
    "Tensor? w2_scale, str weight_format, float beta, float lin_beta, Tensor rms_weight, float eps, Tensor x_s, "
    "Tensor w1_s, Tensor w3_s, Tensor w2_s, str mode, str? group_name=None) -> (Tensor, Tensor)",
    _moe_shared_producer, _moe_shared_producer_fake,
)


def _latent_tail(
    y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str, group_name: str | None = None
) -> torch.Tensor:
    """out [M, H] = round(fp32(y_n @ w_up^T) + sum_r fp32(fragment r)); hidden_scatter all-gathers."""
    validate_tail("latent_tail", y_n, w_up, ws, mode, group_name)
    return select_backend("latent_tail", y_n.device.type, y_n, w_up, ws, mode, group_name).fn(
        y_n, w_up, ws, mode, group_name
    )


def _latent_tail_fake(y_n, w_up, ws, mode, group_name=None):
    validate_tail("latent_tail", y_n, w_up, ws, mode, group_name)
    return y_n.new_empty((y_n.shape[0], w_up.shape[0]))


latent_tail = _define(
    "latent_tail(Tensor y_n, Tensor w_up, Tensor ws, str mode, str? group_name=None) -> Tensor",
    _latent_tail, _latent_tail_fake,
)
