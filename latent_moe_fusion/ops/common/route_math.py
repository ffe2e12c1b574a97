"""Pure-PyTorch math of the router (the gate GEMM and the noaux_tc selection): the definition of lmf::noaux_tc_route
(router/noaux_tc_route.py's docstring states the selection and order exactly), and the router half of the reference
of lmf::route_and_project / lmf::route_and_produce."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    module docstring of router/noaux_tc_route.py defines."""
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
