"""lmf::route_and_project: the router (gate GEMM + lmf::noaux_tc_route) and the latent down-projection
of the same tokens as one op, so that on CUDA they run side by side (beyond the brief, docs/design.md, section 2).

    logits       = x @ gate_weight^T in FP32      router_gemm "fp32": the FP32 GEMM of the widened
                                                  operands; "bf16": the BF16 GEMM with an FP32 output
                                                  (torch.mm(out_dtype=float32); CPU has none: FP32 GEMM)
    ids, weights = lmf::noaux_tc_route(logits, correction_bias, top_k, renorm_eps, scaling_factor,
                                       first_expert, num_local)
    z            = x @ w_down^T                   in x's dtype

The router's outputs are computed by the same calls as the unfused graph makes (its cuBLAS GEMM, the same
route kernel), bit for bit. z is too with LMF_DOWN_PROJECTION=cublas; by default, up to 64 bf16 tokens on Hopper, the
down-projection runs on the tail's Triton swap-AB kernel (ops/routed/router_fused/down_projection.py: FP32 sums, one rounding, another
summation order), which agrees with cuBLAS to bf16 rounding, not bitwise. What changes is the order on the GPU: the
unfused graph runs router GEMM -> route -> down-projection on one stream, although the down-projection does not need
the router. Here the router chain goes first on the caller's stream and the down-projection on a side
stream forked before it; the caller's stream joins before the op returns. The two cuBLAS split-K GEMMs
each take every SM, so the down-projection starts as the router GEMM's programs retire; what runs beside
it is the split-K reduction and the route kernel, 6-8 us per call at decode (H200, Kimi K3 rank, CUDA
graph: bench/results/router_overlap.md).
"""

from __future__ import annotations

import torch

from latent_moe_fusion import tuning

from ...common.backends import ANY_DEVICE, Backend, register_backend, select_backend
from ...common.input_checks import _fail, check_tensor, validate_route_scalars
from ...common.op_library import _define
from ...common.route_math import route_reference, router_logits
from ...common.side_streams import side_stream
from ..routed_thresholds import ROUTED_THRESHOLDS
from .down_projection import project_down

OP = "route_and_project"
ROUTER_GEMMS = ("fp32", "bf16")
# Tuning override (A/B switch): True always side by side, False never; None: by token count. (Whether the fusion pass
# inserts this op at all is FusionConfig.overlap_router.)
OVERLAP_OVERRIDE = "router_overlap_streams"
# Side by side up to this many tokens. H200, Kimi K3 rank, CUDA graph, us (one stream / two): M = 1
# 29.7 / 23.5, M = 32 33.7 / 25.6, M = 64 35.5 / 27.3, M = 128 34.9 / 36.9 (bench/results/router_overlap.md).
# The fusion pass does not insert the op for a static batch above it (fusion_pass/router_overlap.py).
OVERLAP_MAX_TOKENS = ROUTED_THRESHOLDS.value("overlap_max_tokens")
# Which branch is launched first when they run side by side (A/B switch): "router" (default: the router chain
# first on the caller's stream, then the down-projection on the side stream) or "down" (the down-projection
# first, on the side stream; the router chain after it on the caller's stream). Either way the side stream
# forks before both, so neither waits on the other; only the launch order, and so the GPU's, changes. H200,
# compiled fused block: down first is 3-5 % slower at M = 1 / 8 / 32 (docs/design/decode-schedule.md).
OVERLAP_ORDER_OVERRIDE = "router_overlap_order"  # tuning override
OVERLAP_ORDERS = ("router", "down")


def validate_route_and_project(
    x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: torch.Tensor, w_down: torch.Tensor,
    router_gemm: str, top_k: int, renorm_eps: float, scaling_factor: float, first_expert: int, num_local: int,
    op: str = OP,
) -> tuple[int, int, int]:
    """Returns (M, E, L). op: the op named in errors."""
    check_tensor(op, "x", x, ndim=2, dtypes=(torch.bfloat16, torch.float32), device=getattr(x, "device", None))
    if router_gemm not in ROUTER_GEMMS:
        _fail(op, f"router_gemm must be one of {ROUTER_GEMMS}, got {router_gemm!r}")
    if router_gemm == "bf16" and x.dtype != torch.bfloat16:
        _fail(op, f"router_gemm 'bf16' multiplies BF16 operands, but x is {str(x.dtype).replace('torch.', '')}; "
                  "use router_gemm 'fp32'")
    gate_dtypes = (torch.bfloat16,) if router_gemm == "bf16" else (torch.bfloat16, torch.float32)
    check_tensor(op, "gate_weight", gate_weight, ndim=2, dtypes=gate_dtypes, device=x.device)
    check_tensor(op, "w_down", w_down, ndim=2, dtypes=(x.dtype,), device=x.device)
    hidden = x.shape[1]
    if gate_weight.shape[1] != hidden:
        _fail(op, f"gate_weight has shape {tuple(gate_weight.shape)}: expected [E, H = {hidden}] (x is [M, H])")
    if w_down.shape[1] != hidden:
        _fail(op, f"w_down has shape {tuple(w_down.shape)}: expected [L, H = {hidden}] (x is [M, H])")
    num_experts = gate_weight.shape[0]
    check_tensor(op, "correction_bias", correction_bias, ndim=1, dtypes=(torch.float32,), device=x.device)
    if correction_bias.shape[0] != num_experts:
        _fail(op, f"correction_bias has {correction_bias.shape[0]} entries but gate_weight has E = {num_experts} rows")
    validate_route_scalars(op, num_experts, top_k, renorm_eps, scaling_factor, first_expert, num_local)
    return x.shape[0], num_experts, w_down.shape[0]


def route_and_project_reference(x, gate_weight, correction_bias, w_down, router_gemm, top_k, renorm_eps,
                                scaling_factor, first_expert, num_local):
    """Pure PyTorch, any device, one stream: the op's definition."""
    logits = router_logits(x, gate_weight, router_gemm)
    ids, weights = route_reference(logits, correction_bias, top_k, renorm_eps, scaling_factor, first_expert, num_local)
    return ids, weights, torch.mm(x, w_down.t())


tuning.register(OVERLAP_OVERRIDE, tuning.switch("side by side", "one stream"))
tuning.register(OVERLAP_ORDER_OVERRIDE, tuning.choice(OVERLAP_ORDERS, "the branch launched first; None: router"))


def overlap_wanted(num_tokens: int) -> bool:
    forced = tuning.current().router_overlap_streams
    return forced if forced is not None else num_tokens <= OVERLAP_MAX_TOKENS


def overlap_order() -> str:
    return tuning.current().router_overlap_order or "router"


def route_and_project_cuda(x, gate_weight, correction_bias, w_down, router_gemm, top_k, renorm_eps,
                           scaling_factor, first_expert, num_local):
    """The router chain on the caller's stream, the down-projection beside it on a side stream."""
    route_args = (correction_bias, top_k, renorm_eps, scaling_factor, first_expert, num_local)
    if not overlap_wanted(x.shape[0]):
        ids, weights = torch.ops.lmf.noaux_tc_route(router_logits(x, gate_weight, router_gemm), *route_args)
        return ids, weights, project_down(x, w_down, x.new_empty(x.shape[0], w_down.shape[0]))
    main = torch.cuda.current_stream(x.device)
    side = side_stream(x.device, "down_projection")
    # z is allocated on the caller's stream and the side stream joins before the return: no tensor used
    # across the streams outlives the join, so the allocator needs no record_stream.
    z = torch.empty(x.shape[0], w_down.shape[0], dtype=x.dtype, device=x.device)
    side.wait_stream(main)  # the fork precedes the router's launches: the down-projection waits on nothing of them

    def launch_down_projection() -> None:
        with torch.cuda.stream(side):
            project_down(x, w_down, z)

    down_first = overlap_order() == "down"
    if down_first:
        launch_down_projection()
    ids, weights = torch.ops.lmf.noaux_tc_route(router_logits(x, gate_weight, router_gemm), *route_args)
    if not down_first:
        launch_down_projection()
    main.wait_stream(side)
    return ids, weights, z


def _route_and_project(*args):
    validate_route_and_project(*args)
    return select_backend(OP, args[0].device.type, *args).fn(*args)


def _route_and_project_fake(*args):
    m, _, latent = validate_route_and_project(*args)
    x, top_k = args[0], args[5]
    return (x.new_empty((m, top_k), dtype=torch.int32), x.new_empty((m, top_k), dtype=torch.float32),
            x.new_empty((m, latent)))


route_and_project = _define(
    "route_and_project(Tensor x, Tensor gate_weight, Tensor correction_bias, Tensor w_down, str router_gemm, "
    "int top_k, float renorm_eps, float scaling_factor, int first_expert, int num_local) -> (Tensor, Tensor, Tensor)",
    _route_and_project, _route_and_project_fake,
)

register_backend(Backend(OP, "side_stream", 10, ("cuda",), route_and_project_cuda))
register_backend(Backend(OP, "reference", 100, ANY_DEVICE, route_and_project_reference))
