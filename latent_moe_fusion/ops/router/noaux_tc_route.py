"""lmf::noaux_tc_route: Kimi K3's router after the gate GEMM, as one op (beyond the brief, docs/design.md, section 2).

    scores  = sigmoid(logits)                                    [M, E] fp32
    ids     = the top_k largest of scores + correction_bias per row
    weights = scores[ids] / (sum_j scores[ids_j] + renorm_eps) * scaling_factor
    ids     = ids - first_expert where 0 <= ids - first_expert < num_local, else -1   (EP share)

The unfused router (model/router.py) is sigmoid, add, torch.topk(sorted=False), gather, sum, add, div,
mul and, with expert parallelism, five pointwise ops: on the H200 the compiled graph runs them as 3-4
kernels, the top-k alone ~9 us at decode. The fusion pass rewrites that chain into this op.

Exact semantics, so that the rewrite never changes which experts a token goes to:
- Selection: the top_k largest biased scores; ties at the k-th value go to the lower expert index;
  NaN counts as the largest value and -0.0 as smaller than +0.0 (torch.topk's radix order on CUDA).
- Order of the ids within a row: the ids whose biased score is above the k-th value, by ascending
  expert index, then the tied ones, by ascending index. This is the order CUDA torch.topk(sorted=False)
  returns, and the routed op sums the experts in slot order, so the fused graph's ids and its routed
  sums are those of the compiled unfused graph. (CPU torch.topk returns another order: on CPU the
  rewrite may reorder the slots, which changes the routed FP32 sum in its last bits, never the experts
  unless the row has a tie at the k-th value.)
- Weights: the chosen scores summed in FP32 in slot order, then IEEE division and multiplication.
"""

from __future__ import annotations

import torch

from ..common.backends import ANY_DEVICE, Backend, register_backend, select_backend
from ..common.input_checks import _fail, check_tensor, validate_route_scalars
from ..common.op_library import _define
from ..common.route_math import route_reference

OP = "noaux_tc_route"


def validate_route(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renorm_eps: float, scaling_factor: float,
    first_expert: int, num_local: int,
) -> tuple[int, int]:
    """Returns (M, E)."""
    check_tensor(OP, "logits", logits, ndim=2, dtypes=(torch.float32,), device=getattr(logits, "device", None))
    num_experts = logits.shape[1]
    check_tensor(OP, "correction_bias", correction_bias, ndim=1, dtypes=(torch.float32,), device=logits.device)
    if correction_bias.shape[0] != num_experts:
        _fail(OP, f"correction_bias has {correction_bias.shape[0]} entries but logits has E = {num_experts} columns")
    validate_route_scalars(OP, num_experts, top_k, renorm_eps, scaling_factor, first_expert, num_local)
    return logits.shape[0], num_experts


def _route(logits, correction_bias, top_k, renorm_eps, scaling_factor, first_expert, num_local):
    args = (logits, correction_bias, top_k, renorm_eps, scaling_factor, first_expert, num_local)
    validate_route(*args)
    return select_backend(OP, logits.device.type, *args).fn(*args)


def _route_fake(logits, correction_bias, top_k, renorm_eps, scaling_factor, first_expert, num_local):
    m, _ = validate_route(logits, correction_bias, top_k, renorm_eps, scaling_factor, first_expert, num_local)
    return logits.new_empty((m, top_k), dtype=torch.int32), logits.new_empty((m, top_k))


noaux_tc_route = _define(
    "noaux_tc_route(Tensor logits, Tensor correction_bias, int top_k, float renorm_eps, float scaling_factor, "
    "int first_expert, int num_local) -> (Tensor, Tensor)",
    _route, _route_fake,
)

register_backend(Backend(OP, "reference", 100, ANY_DEVICE, route_reference))
