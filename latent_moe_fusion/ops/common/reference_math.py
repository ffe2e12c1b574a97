"""Pure-PyTorch math that defines the ops' semantics (docs/design.md, section 2).

Every function here runs on CPU and GPU and is the reference the fast backends are tested
against. Accumulation is FP32; roundings to the activation dtype happen exactly where the
contract says and nowhere else.
"""

from __future__ import annotations

import torch

from .mxfp4 import dequantize_mxfp4


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU(g, u) = (beta * tanh(g / beta) * sigmoid(g)) * (lin_beta * tanh(u / lin_beta)), FP32."""
    g = g.float()
    u = u.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))


def expert_weight(
    w: torch.Tensor, scale: torch.Tensor | None, weight_format: str, expert: int
) -> torch.Tensor:
    """One expert's weight as FP32 [N, K], dequantized if MXFP4."""
    if weight_format == "mxfp4":
        return dequantize_mxfp4(w[expert], scale[expert], torch.float32)
    return w[expert].float()


def routed_experts_math(
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
    """y[m] = sum_j w[m, j] * W2[e] @ SiTU(W1[e] z[m], W3[e] z[m]), e = ids[m, j]; ids < 0 skipped.

    FP32 accumulation, the intermediate activation rounded to z.dtype before L2, the weighted
    sum FP32 and rounded once. Loops over the experts that received tokens (host sync: this is
    the reference, not the capture-safe path).
    """
    m, latent = z.shape
    inter = w2.shape[-1] if weight_format == "bf16" else w2.shape[-1] * 2
    acc = torch.zeros(m, latent, dtype=torch.float32, device=z.device)
    zf = z.float()
    for expert in torch.unique(topk_ids[topk_ids >= 0]).tolist():
        rows, slots = torch.nonzero(topk_ids == expert, as_tuple=True)
        w13_e = expert_weight(w13, w13_scale, weight_format, expert)
        w2_e = expert_weight(w2, w2_scale, weight_format, expert)
        h = zf[rows] @ w13_e.t()
        act = situ(h[:, :inter], h[:, inter:], beta, lin_beta).to(z.dtype).float()
        out = act @ w2_e.t()
        acc.index_add_(0, rows, out * topk_weights[rows, slots].float().unsqueeze(1))
    return acc.to(z.dtype)


def rms_norm_math(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with FP32 statistics and FP32 weight multiply, rounded once to y.dtype."""
    yf = y.float()
    inv = torch.rsqrt(yf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (yf * inv * weight.float()).to(y.dtype)


def shared_expert_math(
    x_s: torch.Tensor,
    w1_s: torch.Tensor,
    w3_s: torch.Tensor,
    w2_s: torch.Tensor,
    beta: float,
    lin_beta: float,
) -> torch.Tensor:
    """This rank's partial shared-expert output [M_s, H] in x_s.dtype.

    Gate and up products FP32-accumulated and rounded to x_s.dtype (as the unfused nn.Linear
    outputs are), SiTU in FP32 rounded to x_s.dtype, down product FP32-accumulated and rounded
    once (the fragment the tail reads is in the activation dtype).
    """
    xf = x_s.float()
    g = (xf @ w1_s.float().t()).to(x_s.dtype)
    u = (xf @ w3_s.float().t()).to(x_s.dtype)
    act = situ(g, u, beta, lin_beta).to(x_s.dtype).float()
    return (act @ w2_s.float().t()).to(x_s.dtype)


def tail_math(y_n: torch.Tensor, w_up: torch.Tensor, fragments: torch.Tensor) -> torch.Tensor:
    """out = round(fp32(y_n @ w_up^T) + sum_r fp32(fragments[r])), fragments [R, M, N], r in order."""
    acc = y_n.float() @ w_up.float().t()
    for r in range(fragments.shape[0]):
        acc = acc + fragments[r].float()
    return acc.to(y_n.dtype)
