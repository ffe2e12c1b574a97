"""Plain-torch pieces of the unfused block, written the way models write them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def situ_activation(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU in float32, rounded back to the input dtype."""
    gf = g.float()
    uf = u.float()
    act = (beta * torch.tanh(gf / beta) * torch.sigmoid(gf)) * (lin_beta * torch.tanh(uf / lin_beta))
    return act.to(g.dtype)


def rms_norm_functional(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(y, (y.shape[-1],), weight, eps)


def rms_norm_manual(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The usual hand-written float32 RMSNorm (weight multiplied before the final rounding)."""
    yf = y.float()
    variance = yf.pow(2).mean(-1, keepdim=True)
    return (yf * torch.rsqrt(variance + eps) * weight.float()).to(y.dtype)


RMS_NORMS = {"functional": rms_norm_functional, "manual": rms_norm_manual}
