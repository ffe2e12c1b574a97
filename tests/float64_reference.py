"""Float64 math of the lmf ops, written independently of latent_moe_fusion/ops (loops, no roundings).

Tests compare the ops against these functions with a relative L2 error bound: the ops round where
docs/design.md says they do, these never round, so the bound reflects the activation dtype's precision.
"""

from __future__ import annotations

import torch

F64 = torch.float64
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    ref = ref.to(F64)
    return ((out.to(F64) - ref).norm() / ref.norm()).item()


def decode_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed uint8 [..., N, K/2] (low nibble = even element) + E8M0 [..., N, K/32] -> float64 [..., N, K]."""
    nibbles = torch.stack([packed.long() & 0xF, packed.long() >> 4], dim=-1).flatten(-2)
    magnitude = torch.tensor(E2M1_MAGNITUDES, dtype=F64, device=packed.device)[nibbles & 0x7]
    sign = 1.0 - 2.0 * ((nibbles >> 3) & 1).to(F64)
    block_scale = torch.pow(2.0, scales.to(F64) - 127.0).repeat_interleave(32, dim=-1)
    return sign * magnitude * block_scale


def expert_weights64(w: torch.Tensor, scale: torch.Tensor | None, weight_format: str) -> torch.Tensor:
    return decode_mxfp4(w, scale) if weight_format == "mxfp4" else w.to(F64)


def situ64(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lin_beta * torch.tanh(u / lin_beta)


def routed64(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta) -> torch.Tensor:
    """y[m] = sum_j w[m, j] * W2[e] @ SiTU(W1[e] z[m], W3[e] z[m]) for e = ids[m, j] >= 0, expert by expert over
    its (token, slot) pairs (on the inputs' device: float64 on a GPU keeps the Kimi-size references quick)."""
    z = z.to(F64)
    ids = topk_ids.long()
    y = torch.zeros(z.shape, dtype=F64, device=z.device)
    for e in ids[ids >= 0].unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        w13_e = expert_weights64(w13[e], None if w13_scale is None else w13_scale[e], weight_format)
        w2_e = expert_weights64(w2[e], None if w2_scale is None else w2_scale[e], weight_format)
        inter = w2_e.shape[-1]
        h = z[tokens] @ w13_e.T
        act = situ64(h[:, :inter], h[:, inter:], beta, lin_beta)
        y.index_add_(0, tokens, topk_weights[tokens, slots].to(F64)[:, None] * (act @ w2_e.T))
    return y


def rms_norm64(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = y.to(F64)
    return y / torch.sqrt((y * y).mean(dim=-1, keepdim=True) + eps) * weight.to(F64)


def shared64(x_s, w1_s, w3_s, w2_s, beta, lin_beta) -> torch.Tensor:
    x = x_s.to(F64)
    act = situ64(torch.einsum("mh,ih->mi", x, w1_s.to(F64)), torch.einsum("mh,ih->mi", x, w3_s.to(F64)), beta, lin_beta)
    return torch.einsum("mi,hi->mh", act, w2_s.to(F64))


def tail64(y_n: torch.Tensor, w_up: torch.Tensor, fragments: list[torch.Tensor]) -> torch.Tensor:
    out = torch.einsum("ml,hl->mh", y_n.to(F64), w_up.to(F64))
    for fragment in fragments:
        out = out + fragment.to(F64)
    return out
