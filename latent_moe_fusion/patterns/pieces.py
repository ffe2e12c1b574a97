"""Building blocks of the search patterns, written the way the unfused block's post-grad graph reads.

Each piece is plain torch (traced by `fwd_only` into the same aten ops Inductor sees), except the
functional RMSNorm: tracing `F.rms_norm` gives an in-place add and a baked eps, while the compiled
graph holds the explicit decomposition below (pow, mean over the last dim as a non-negative index,
add.Scalar(eps), rsqrt, two muls; docs/design/fusion-pass.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for an nn.Linear weight [out, in]; traces to permute + mm."""
    return F.linear(x, weight)


def situ(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU in float32, rounded back to the input dtype (the shared expert's activation)."""
    gf = g.float()
    uf = u.float()
    act = (beta * torch.tanh(gf / beta) * torch.sigmoid(gf)) * (lin_beta * torch.tanh(uf / lin_beta))
    return act.to(g.dtype)


def rms_norm_functional(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What `F.rms_norm(y, (L,), weight, eps)` becomes in the post-grad graph."""
    yf = y.float()
    variance = aten.mean.dim(yf.pow(2), [y.dim() - 1], True)
    inverse = aten.rsqrt.default(aten.add.Scalar(variance, eps))
    return (yf * inverse * weight).to(y.dtype)


def rms_norm_manual(y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The usual hand-written float32 RMSNorm (weight multiplied in float32, one rounding)."""
    yf = y.float()
    variance = yf.pow(2).mean(-1, keepdim=True)
    return (yf * torch.rsqrt(variance + eps) * weight.float()).to(y.dtype)


RMS_NORMS = {"functional": rms_norm_functional, "manual": rms_norm_manual}


def gate_up_merged(x_s: torch.Tensor, shared_w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One [2 I_s, H] matmul, gate rows first, split in two."""
    gate, up = linear(x_s, shared_w13).chunk(2, dim=-1)
    return gate, up


def gate_up_split(x_s: torch.Tensor, shared_w1: torch.Tensor, shared_w3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return linear(x_s, shared_w1), linear(x_s, shared_w3)


def merged_row_blocks(shared_w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate and up weights of a merged [2 I_s, H] parameter as two row-block views (no copy)."""
    inter = shared_w13.shape[0] // 2
    return shared_w13[:inter], shared_w13[inter:]
