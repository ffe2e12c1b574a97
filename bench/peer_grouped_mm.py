"""A third row beside ours and the peer: the routed experts on torch._grouped_mm over BF16 weights.

Hopper has no stock MXFP4 grouped GEMM, so the weights are dequantised to BF16 once (4x the bytes of MXFP4 per
expert read). Per call, all on the device (no host sync, CUDA-graph safe): the (token, slot) pairs sorted by expert
(skipped slots last, outside every group), per-expert row ends, L1 by `torch._grouped_mm` (its output BF16, so h is
rounded to BF16 before SiTU, unlike ours and the peer's, which apply SiTU to the FP32 accumulator), SiTU in FP32 rounded
to BF16, L2 by `torch._grouped_mm`, then the weighted sum over the slots in FP32 and one rounding to BF16.
"""

from __future__ import annotations

import torch

from latent_moe_fusion.ops import dequantize_mxfp4


def _situ(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    g, u = g.float(), u.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))


def dequantized_bf16(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 [E, N, K/2] + [E, N, K/32] -> BF16 [E, N, K], one expert at a time (no FP32 copy of all experts)."""
    out = torch.empty(*w.shape[:-1], w.shape[-1] * 2, dtype=torch.bfloat16, device=w.device)
    for e in range(w.shape[0]):
        out[e] = dequantize_mxfp4(w[e], scale[e], torch.bfloat16)
    return out


class GroupedMMExperts:
    """y = routed experts of one rank through torch._grouped_mm on BF16 copies of the MXFP4 weights."""

    def __init__(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                 beta: float, lin_beta: float) -> None:
        self.w13_kn = dequantized_bf16(w13, w13_scale).transpose(1, 2)  # [E, L, 2I], the layout _grouped_mm takes
        self.w2_kn = dequantized_bf16(w2, w2_scale).transpose(1, 2)  # [E, I, L]
        self.beta, self.lin_beta = beta, lin_beta

    def weight_bytes_per_expert(self) -> int:
        return sum(w[0].numel() * w.element_size() for w in (self.w13_kn, self.w2_kn))

    def __call__(self, z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        m, top_k = topk_ids.shape
        num_experts, latent, two_inter = self.w13_kn.shape
        flat = topk_ids.reshape(-1).long()
        key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # skipped pairs sort last
        sorted_key, order = torch.sort(key, stable=True)
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=z.device)
        counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        row_ends = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
        tokens = order // top_k
        h = torch._grouped_mm(z[tokens], self.w13_kn, offs=row_ends)
        act = _situ(h[:, : two_inter // 2], h[:, two_inter // 2:], self.beta, self.lin_beta).to(z.dtype)
        out = torch._grouped_mm(act, self.w2_kn, offs=row_ends)
        weights = topk_weights.reshape(-1)[order]
        contrib = torch.where((sorted_key < num_experts)[:, None], out.float() * weights[:, None], 0.0)
        y = torch.zeros(m, latent, dtype=torch.float32, device=z.device)
        return y.index_add_(0, tokens, contrib).to(z.dtype)
