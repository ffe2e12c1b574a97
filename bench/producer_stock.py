"""The unfused stock sequence the fused producer is compared with (PyTorch ops only, capture-safe).

Routed experts through torch._grouped_mm (BF16; Hopper has no stock MXFP4 grouped GEMM), grouping
on the device (sort + counts + cumsum, no host sync), SiTU in torch, FP32 weighted top-k sum;
the shared MLP as three F.linear calls with SiTU in torch; then F.rms_norm.
torch._grouped_mm rounds h to BF16 before SiTU (the contract keeps it FP32), so its error against
the reference is a little larger than the fused path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from latent_moe_fusion.ops.common.reference_math import situ


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def stock_routed(
    z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    beta: float, lin_beta: float,
) -> torch.Tensor:
    m, top_k = topk_ids.shape
    num_experts, two_inter, latent = w13.shape
    inter = two_inter // 2
    flat = topk_ids.reshape(-1).long()
    key = torch.where(flat < 0, num_experts, flat)  # pairs of other ranks sort last, outside every group
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=z.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    a = z[order // top_k]
    h = torch._grouped_mm(a, w13.transpose(1, 2), offs=offs)
    act = situ(h[:, :inter], h[:, inter:], beta, lin_beta).to(z.dtype)
    out = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    weights = topk_weights.reshape(-1)[order]
    contrib = torch.where((sorted_key < num_experts)[:, None], out.float() * weights[:, None], 0.0)
    pairs = torch.zeros(m * top_k, latent, dtype=torch.float32, device=z.device).index_copy_(0, order, contrib)
    return pairs.view(m, top_k, latent).sum(1).to(z.dtype)


def stock_shared(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, beta: float,
                 lin_beta: float) -> torch.Tensor:
    act = situ(F.linear(x, w1), F.linear(x, w3), beta, lin_beta).to(x.dtype)
    return F.linear(act, w2)


def stock_rms_norm(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(y, (y.shape[-1],), weight, eps)
