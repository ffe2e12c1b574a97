"""lmf::route_and_produce: lmf::route_and_project and the lmf::moe_shared_producer it feeds as one op, so that
on CUDA the shared expert can start first, beside the router and the down-projection (beyond the brief,
docs/design.md, section 2; the producer's semantics and outputs are unchanged).

    ids, weights, z = lmf::route_and_project(x, gate_weight, correction_bias, w_down, router_gemm, top_k,
                                             renorm_eps, scaling_factor, first_expert, num_local)
    y_n, ws         = lmf::moe_shared_producer(z, ids, weights, w13, w2, w13_scale, w2_scale, weight_format,
                                               beta, lin_beta, rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode,
                                               group_name)

Why: inside the producer the shared expert can only start once the router and the down-projection are
done, and then runs beside the routed kernels, which are issue-bound and slowed by it. Its inputs are the
tokens, so it can run beside the router and the down-projection instead, which read weights at the copy
rate with SM slots to spare. The shared-first schedule (CUDA, MXFP4 routed weights, the Triton producer):

    side stream 1:  shared expert (cuBLAS GEMMs, the producer's own from 5 tokens on) -> fragments
    router stream:  router GEMM -> lmf::noaux_tc_route -> expert grouping -> routed L1, L2, combine + RMSNorm
    side stream 2:  latent down-projection z                           (the routed L1 waits for it)

launched in the order shared_first_order gives (the router chain first up to 32 tokens, the shared expert
first beyond). The router stream is the caller's, or up to 8 tokens an urgent (high-priority) stream, with
the down-projection's stream urgent too (shared_first_urgent), so the shared expert's GEMMs yield SM slots.

Every kernel is the one the two ops launch (same GEMMs, route, grouping and routed kernels), so outputs are
bitwise those of the two ops wherever the producer runs its shared expert by cuBLAS (beside the register-dequant
kernels: from 5 tokens on); only the order on the GPU changes. H200, compiled + fused Kimi K3 rank block in CUDA
graphs, shared first on / off by the shared_first_schedule tuning override on one compile (bench/results/decode_tuning_shared_first.md,
us): M = 8 129.6 / 137.4, M = 16 179.6 / 186.1, M = 32 247.1 / 254.2, M = 64 294.3 / 301.8, M = 128 376.5 /
389.6; M = 1 78.1 / 76.7 (the producer's Triton shared grids beside the GEMV kernels win there), hence from
SHARED_FIRST_MIN_TOKENS on. Elsewhere the op runs the two ops in a row.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from latent_moe_fusion import tuning

from ...common.backends import ANY_DEVICE, Backend, register_backend, select_backend
from ...common.fragment_layouts import PendingFragments, fragment_buffers, fragment_shape, group_size, start_publish
from ...common.input_checks import LmfInputError, _fail
from ...common.op_library import _define
from ...common.route_math import router_logits
from ...common.side_streams import side_stream
from ..backend_dispatch import _run_routed_backend
from ..producer_op import _validate_producer
from ..routed_thresholds import ROUTED_THRESHOLDS
from .down_projection import project_down
from .route_and_project import route_and_project_cuda, route_and_project_reference, validate_route_and_project

OP = "route_and_produce"
# Tuning override (A/B switch): True always shared-first, False never; None: by token count. (Whether the fusion pass
# inserts this op at all is FusionConfig.shared_first.)
SHARED_FIRST_OVERRIDE = "shared_first_schedule"
# Below: the producer's Triton shared grids beside the routed GEMV kernels win
SHARED_FIRST_MIN_TOKENS = ROUTED_THRESHOLDS.value("shared_first_min_tokens")
# Above: prefill, outside CUDA graphs, where the extra host time before the first launch delays the forward;
# the fusion pass does not insert the op for a static batch above it (fusion_pass/router_overlap.py).
SHARED_FIRST_MAX_TOKENS = ROUTED_THRESHOLDS.value("shared_first_max_tokens")
# In which order the three branches of the shared-first schedule are launched (A/B switch): a permutation of
# "shared", "router" (router GEMM, route, grouping) and "down" (the down-projection). Every side stream forks
# before any of them, so the order only decides which kernels the GPU starts first: the cuBLAS GEMMs of each
# take every SM, so they run largely in launch order. H200 block, alternating rounds in one process
# (bench/results/decode_tuning_shared_first_urgent.md; docs/design/decode-schedule.md): router first, then the shared expert, then the down-projection is
# 2-6 us faster than the shared expert first at M = 16 and 32 in four runs, 3 and 8-9 us slower at M = 64
# and 128. Hence the router chain first up to ROUTER_FIRST_MAX_TOKENS tokens, the shared expert first beyond.
SHARED_FIRST_ORDER_OVERRIDE = "shared_first_order"  # tuning override
SHARED_FIRST_BRANCHES = ("shared", "router", "down")
ROUTER_FIRST_MAX_TOKENS = ROUTED_THRESHOLDS.value("router_first_max_tokens")
# Which branches of the shared-first schedule go on urgent (high-priority) streams (ops/common/side_streams.py), so that
# the block scheduler gives them SM slots before the shared expert's GEMMs: "none"; "route" (the router
# chain and the down-projection, which the routed L1 waits for; the routed experts on the caller's stream);
# "all" ("route" and the routed experts). A/B switch (tuning override), read per call (each CUDA graph keeps what it
# captured).
# H200 block (same files): "all" with the order above is 3.1 / 3.3 us faster than "none" at M = 8 in two runs;
# beyond 8 tokens urgency costs 3-4.5 us at M = 16, is within 1.2 us at 32 and 64 and costs 6-9 us at 128.
SHARED_FIRST_URGENT_OVERRIDE = "shared_first_urgent"  # tuning override
SHARED_FIRST_URGENT_CHOICES = ("none", "route", "all")
URGENT_MAX_TOKENS = ROUTED_THRESHOLDS.value("urgent_max_tokens")


def validate_route_and_produce(*args, op: str = OP) -> tuple[int, int, int, int]:
    """Both ops' checks (the producer's on stand-ins for the router's outputs). Returns (M, H_s, R, L). op: the op
    named in errors."""
    route_args, produce_args = args[:10], args[10:]
    m, _, latent = validate_route_and_project(*route_args, op=op)
    x, top_k = args[0], args[5]
    ids = x.new_empty((m, top_k), dtype=torch.int32)
    weights = x.new_empty((m, top_k), dtype=torch.float32)
    z = x.new_empty((m, latent))
    try:
        m, hidden, world, num_experts = _validate_producer(z, ids, weights, *produce_args, ids=False, op=op)
    except LmfInputError as exc:  # the producer's checks name z, which this op computes from x and w_down
        if not re.search(r"\bz\b", str(exc)):
            raise
        raise LmfInputError(f"{exc} (here z = x @ w_down^T is [M = {m}: x's rows, L = {latent}: w_down's rows])") \
            from None
    if args[9] != num_experts:
        _fail(op, f"num_local = {args[9]} but w13 holds {num_experts} experts: the route's ids index w13's experts")
    return m, hidden, world, latent


tuning.register(SHARED_FIRST_OVERRIDE, tuning.switch("shared expert first", "never"))
tuning.register(SHARED_FIRST_ORDER_OVERRIDE,
                tuning.permutation(SHARED_FIRST_BRANCHES, "the three branches (in launch order)"))
tuning.register(SHARED_FIRST_URGENT_OVERRIDE,
                tuning.choice(SHARED_FIRST_URGENT_CHOICES, "the branches on urgent streams"))


def shared_first_wanted(num_tokens: int) -> bool:
    forced = tuning.current().shared_first_schedule
    return forced if forced is not None else SHARED_FIRST_MIN_TOKENS <= num_tokens <= SHARED_FIRST_MAX_TOKENS


def shared_first_order(num_tokens: int) -> tuple[str, ...]:
    """The launch order of the shared-first schedule's branches (the shared_first_order override, else by token
    count)."""
    forced = tuning.current().shared_first_order
    if forced is not None:
        return forced
    return ("router", "shared", "down") if num_tokens <= ROUTER_FIRST_MAX_TOKENS else ("shared", "router", "down")


def shared_first_urgent(num_tokens: int) -> str:
    """Which branches go on urgent streams (the shared_first_urgent override, else by token count)."""
    forced = tuning.current().shared_first_urgent
    return forced or ("all" if num_tokens <= URGENT_MAX_TOKENS else "none")


def _produce(z, ids, weights, produce_args: tuple):
    """lmf::moe_shared_producer's backend on the router's outputs; the op checked its arguments already
    (validate_route_and_produce), so this skips the producer's own validation (host time outside graphs)."""
    return _run_routed_backend("moe_shared_producer", ids, produce_args[0].shape[0], (z, ids, weights, *produce_args))


def route_and_produce_reference(x, gate_weight, correction_bias, w_down, router_gemm, top_k, renorm_eps,
                                scaling_factor, first_expert, num_local, *produce_args):
    """The two ops in a row, any device: the op's definition."""
    ids, weights, z = route_and_project_reference(x, gate_weight, correction_bias, w_down, router_gemm, top_k,
                                                  renorm_eps, scaling_factor, first_expert, num_local)
    return _produce(z, ids, weights, produce_args)


def _triton_producer_serves(args: tuple, z: torch.Tensor) -> bool:
    """Whether the producer would run on the Triton backend, whose kernels the shared-first schedule calls."""
    x, top_k = args[0], args[5]
    stand_ins = (x.new_empty((x.shape[0], top_k), dtype=torch.int32),
                 x.new_empty((x.shape[0], top_k), dtype=torch.float32))
    try:
        return select_backend("moe_shared_producer", "cuda", z, *stand_ins, *args[10:]).name == "triton"
    except RuntimeError:
        return False


def route_and_produce_cuda(x, gate_weight, correction_bias, w_down, router_gemm, top_k, renorm_eps, scaling_factor,
                           first_expert, num_local, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
                           rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name=None, *,
                           gather: Callable[[], None] | None = None):
    """The shared-first schedule (module docstring) where it pays, else the two ops in a row.

    gather: fills x_s on the stream current when it is called (lmf::route_gather_and_produce: x_s is then an
    unfilled buffer made on the caller's stream). It is called on the shared expert's stream, so only the shared
    expert waits for it; in a row, the router and the down-projection run on the caller's stream beside it."""
    args = (x, gate_weight, correction_bias, w_down, router_gemm, top_k, renorm_eps, scaling_factor, first_expert,
            num_local, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta, rms_weight, eps, x_s, w1_s, w3_s,
            w2_s, mode, group_name)
    # z, ws and x_s are allocated on the caller's stream and every side stream joins before the return: no tensor
    # used across the streams outlives the join, so the allocator needs no record_stream.
    shared_first = shared_first_wanted(x.shape[0]) and weight_format == "mxfp4"
    z = torch.empty(x.shape[0], w_down.shape[0], dtype=x.dtype, device=x.device) if shared_first else None
    if not (shared_first and _triton_producer_serves(args, z)):
        if gather is None:
            ids, weights, z = route_and_project_cuda(*args[:10])
            return _produce(z, ids, weights, args[10:])
        main, beside = torch.cuda.current_stream(x.device), side_stream(x.device, "shared_first")
        beside.wait_stream(main)  # x is ready there
        with torch.cuda.stream(beside):
            gather()
        ids, weights, z = route_and_project_cuda(*args[:10])
        main.wait_stream(beside)  # the producer reads x_s
        return _produce(z, ids, weights, args[10:])
    main = torch.cuda.current_stream(x.device)
    shared_stream = side_stream(x.device, "shared_first")
    from ..expert_schedule import planned_grouping, run_experts
    from ..shared_by_library import shared_by_library

    world, (m_s, hidden) = group_size(group_name), x_s.shape
    ws = x_s.new_empty(fragment_shape(mode, x.shape[0], hidden, 1)) if world == 1 else None
    s_out = ws.view(m_s, hidden) if world == 1 else x_s.new_empty(m_s, hidden)
    # R > 1: the fragments go out from the shared expert's stream as soon as it is done, beside the routed
    # experts; their buffers are made here, on the caller's stream, which waits for the exchange before returning.
    buffers = fragment_buffers(m_s, hidden, mode, world, x_s, group_name) if world > 1 else None
    published: list[PendingFragments] = []
    urgent = shared_first_urgent(x.shape[0])
    down_stream = side_stream(x.device, "down_projection", urgent=urgent != "none")
    router_stream = side_stream(x.device, "router", urgent=True) if urgent != "none" else main
    for stream in {shared_stream, down_stream, router_stream} - {main}:
        stream.wait_stream(main)  # every fork precedes the router's launches: no side waits on them
    routed: dict = {}

    def shared() -> None:
        with torch.cuda.stream(shared_stream):
            if gather is not None:
                gather()  # every rank's tokens, waited for on this stream only
            shared_by_library(x_s, w1_s, w3_s, w2_s, s_out, beta, lin_beta)
            if buffers is not None:
                published.append(start_publish(s_out, mode, group_name, buffers))

    def router() -> None:
        with torch.cuda.stream(router_stream):
            routed["ids"], routed["weights"] = torch.ops.lmf.noaux_tc_route(
                router_logits(x, gate_weight, router_gemm), correction_bias, top_k, renorm_eps, scaling_factor,
                first_expert, num_local)
            # The grouping beside the down-projection.
            routed["grouping"] = planned_grouping(z, routed["ids"], w13, w2, weight_format, w13_scale, w2_scale)

    def down() -> None:
        with torch.cuda.stream(down_stream):
            project_down(x, w_down, z)

    branches = {"shared": shared, "router": router, "down": down}
    for branch in shared_first_order(x.shape[0]):
        branches[branch]()
    ids, weights, grouping = routed["ids"], routed["weights"], routed["grouping"]
    experts_stream = router_stream if urgent == "all" else main
    for stream in {down_stream, router_stream} - {experts_stream}:
        experts_stream.wait_stream(stream)
    with torch.cuda.stream(experts_stream):
        y_n = run_experts(z, ids, weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
                          rms_weight=rms_weight, eps=eps, shared=None, grouping=grouping)
    for stream in {experts_stream, shared_stream} - {main}:
        main.wait_stream(stream)
    # Tensors made on the urgent stream and read or returned on the caller's: the allocator must not hand
    # their memory to that stream's next allocation before the caller's stream is done with them.
    if experts_stream is not main:
        y_n.record_stream(main)
    elif router_stream is not main:
        for tensor in (ids, weights, *(grouping.tensors() if grouping else ())):
            tensor.record_stream(main)
    if world > 1:
        ws = published[0].wait()
    return y_n, ws


NUM_ARGS = 25


def _all_args(args: tuple) -> tuple:
    """The dispatcher leaves out a trailing argument equal to its default (group_name=None)."""
    return args + (None,) * (NUM_ARGS - len(args))


def _route_and_produce(*args):
    args = _all_args(args)
    validate_route_and_produce(*args)
    return select_backend(OP, args[0].device.type, *args).fn(*args)


def _route_and_produce_fake(*args):
    args = _all_args(args)
    m, hidden, world, latent = validate_route_and_produce(*args)
    x, x_s, mode = args[0], args[19], args[23]
    return x.new_empty((m, latent)), x_s.new_empty(fragment_shape(mode, m, hidden, world))


route_and_produce = _define(
    "route_and_produce(Tensor x, Tensor gate_weight, Tensor correction_bias, Tensor w_down, str router_gemm, "
    "int top_k, float renorm_eps, float scaling_factor, int first_expert, int num_local, Tensor w13, Tensor w2, "
    "Tensor? w13_scale, Tensor? w2_scale, str weight_format, float beta, float lin_beta, Tensor rms_weight, "
    "float eps, Tensor x_s, Tensor w1_s, Tensor w3_s, Tensor w2_s, str mode, str? group_name=None) "
    "-> (Tensor, Tensor)",
    _route_and_produce, _route_and_produce_fake,
)

register_backend(Backend(OP, "shared_first", 10, ("cuda",), route_and_produce_cuda))
register_backend(Backend(OP, "reference", 100, ANY_DEVICE, route_and_produce_reference))
