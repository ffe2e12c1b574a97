"""lmf::noaux_tc_route: Kimi K3's router after the gate GEMM, as one op (beyond DESIGN.md section 2).

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

import math

import torch
import torch.nn.functional as F

from .backends import Backend, register_backend, select_backend
from .library import _define
from .reference import ANY_DEVICE
from .validation import _fail, check_tensor

OP = "noaux_tc_route"


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor, gemm: str) -> torch.Tensor:
    """FP32 logits [..., E] = x @ gate_weight^T, as the model computes them (model/router.router_logits
    documents the two forms): gemm "bf16" on CUDA with BF16 operands is one BF16 GEMM with an FP32
    output; otherwise the FP32 GEMM of the widened operands."""
    if gemm == "bf16" and x.is_cuda and x.dtype == gate_weight.dtype == torch.bfloat16:
        return torch.mm(x.reshape(-1, x.shape[-1]), gate_weight.t(), out_dtype=torch.float32).reshape(
            *x.shape[:-1], gate_weight.shape[0])
    return F.linear(x.float(), gate_weight.float())


def ordered_keys(values: torch.Tensor) -> torch.Tensor:
    """int32 keys whose signed order is torch.topk's order of the fp32 values (NaN largest, -0.0 < +0.0)."""
    bits = values.contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return torch.where(torch.isnan(values), torch.full_like(keys, 0x7FFFFFFF), keys)


def topk_ids_cuda_order(values: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices [M, top_k] (int64) of the top_k largest values per row, in the selection and order the
    module docstring defines."""
    keys = ordered_keys(values)
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices  # ties keep ascending index
    chosen = order[:, :top_k]
    chosen_keys = keys.gather(-1, chosen)
    kth = chosen_keys[:, top_k - 1 :]
    num_experts = values.shape[-1]
    slot_key = torch.where(chosen_keys > kth, 0, num_experts) + chosen  # above the k-th first, then ties
    return chosen.gather(-1, torch.sort(slot_key, dim=-1).indices)


def localize(ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Global ids -> ids of this rank's experts; experts held elsewhere become -1 (the EP share the model
    applies as model.router.localize_ids, and the fusion pass folds into the op)."""
    local = ids - first_expert
    return torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, -1))


def route_reference(
    logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, renorm_eps: float, scaling_factor: float,
    first_expert: int, num_local: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure PyTorch, any device: the op's definition."""
    scores = torch.sigmoid(logits)
    chosen = topk_ids_cuda_order(scores + correction_bias, top_k)
    weights = scores.gather(-1, chosen)
    total = weights[:, 0]
    for j in range(1, top_k):  # slot order, one FP32 addition at a time
        total = total + weights[:, j]
    weights = weights / (total[:, None] + renorm_eps) * scaling_factor
    return localize(chosen.to(torch.int32), first_expert, num_local), weights


def validate_route_scalars(
    op: str, num_experts: int, top_k: int, renorm_eps: float, scaling_factor: float, first_expert: int,
    num_local: int,
) -> None:
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        _fail(op, f"top_k must be an int in [1, E = {num_experts}], got {top_k!r}")
    if not (isinstance(renorm_eps, (int, float)) and math.isfinite(renorm_eps) and renorm_eps >= 0):
        _fail(op, f"renorm_eps must be a finite number >= 0, got {renorm_eps!r}")
    if not (isinstance(scaling_factor, (int, float)) and math.isfinite(scaling_factor)):
        _fail(op, f"scaling_factor must be a finite number, got {scaling_factor!r}")
    if not isinstance(first_expert, int) or not 0 <= first_expert < num_experts:
        _fail(op, f"first_expert must be an int in [0, E = {num_experts}), got {first_expert!r}")
    if not isinstance(num_local, int) or not 1 <= num_local <= num_experts - first_expert:
        _fail(op, f"num_local must be an int in [1, E - first_expert = {num_experts - first_expert}], got {num_local!r}")


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
