"""lmf::routed_experts through DeepGEMM's BF16 M-grouped GEMMs (sm_90), opt-in until measured faster.

API mapped (deepseek-ai/DeepGEMM, csrc/apis/gemm.hpp and csrc/jit_kernels/impls/sm90_bf16_gemm.hpp
at commit 54e2261; the fork keeps them unchanged):

  m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims='nk')
      a [G, M_max, K] bf16, b [G, N, K] bf16, d [G, M_max, N] bf16 (rows >= masked_m[g] untouched),
      masked_m int32 [G], expected_m > 0 a hint; sm_90 needs K % 64 == 0.
  m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims='nk',
      use_psum_layout=False, ensure_zero_padding=True, expected_m_for_psum_layout=None)
      a [M, K] bf16 rows grouped by expert, each group padded to get_mk_alignment_for_contiguous_layout()
      rows, grouped_layout int32 [M] = group of each row, -1 on padding rows; d [M, N] bf16.

Mapping: ids/weights -> a routing plan built on the device without host synchronisation (so it can
be captured in a CUDA graph): duplicate ids within a token are merged (their weights summed,
exactly what the contract's sum over slots gives), ids < 0 dropped. Decode sizes use the masked
layout (A is [E, M, L]); larger M the contiguous one. L1 [2I rows: gate then up] -> SiTU in FP32
-> BF16 -> L2 -> weighted FP32 sum over the top-k -> BF16.

Numerics: DeepGEMM's grouped GEMMs write BF16 only, so h = z @ W13^T and each expert's L2 output
are rounded to BF16 before SiTU / the weighted sum, where the contract keeps them in FP32. The
difference is one BF16 rounding (relative error ~2**-9 per element); tests use a looser bound.
MXFP4 weights are dequantized to BF16 once per weight version (cached): exact, but 4x the bytes.
There is no FP8 weight format in the op contract, so DeepGEMM's FP8 grouped variants are not used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from ..backends import forced_backend_name
from ..math import situ
from ..mxfp4 import dequantize_mxfp4
from .agree import current_answer
from .probe import SM90_GROUPED, deep_gemm_module
from .weights import WeightCache

NAME = "deepgemm"
LAYOUT_ENV = "LMF_DEEPGEMM_ROUTED_LAYOUT"  # masked | contiguous (default: by M)
MASKED_MAX_M = 128
_BF16_COPIES = WeightCache("DeepGEMM routed: BF16 copies of MXFP4 weights")


def available() -> str | None:
    return current_answer().why_not(SM90_GROUPED)


def supports(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta) -> str | None:
    if forced_backend_name("routed_experts") != NAME:
        return (f"opt-in until measured faster than Triton: set LMF_BACKEND_ROUTED_EXPERTS={NAME} "
                f"(or LMF_BACKEND={NAME})")
    if z.dtype != torch.bfloat16:
        return f"DeepGEMM BF16 grouped GEMMs need z in bfloat16, got {z.dtype}"
    latent = z.shape[1]
    inter = w13.shape[1] // 2
    if latent % 64 or inter % 64:
        return f"sm_90 grouped GEMMs need K % 64 == 0: L = {latent}, I = {inter}"
    return None


def bf16_weights(w13, w2, w13_scale, w2_scale, weight_format) -> tuple[torch.Tensor, torch.Tensor]:
    if weight_format == "bf16":
        return w13, w2

    def convert() -> tuple[torch.Tensor, torch.Tensor]:
        # One expert at a time: dequantizing all at once would need ~8 bytes per weight of temporaries.
        out13 = torch.empty((*w13.shape[:2], w13.shape[2] * 2), dtype=torch.bfloat16, device=w13.device)
        out2 = torch.empty((*w2.shape[:2], w2.shape[2] * 2), dtype=torch.bfloat16, device=w2.device)
        for e in range(w13.shape[0]):
            out13[e] = dequantize_mxfp4(w13[e], w13_scale[e], torch.bfloat16)
            out2[e] = dequantize_mxfp4(w2[e], w2_scale[e], torch.bfloat16)
        return out13, out2

    return _BF16_COPIES.get((w13, w2, w13_scale, w2_scale), convert)


@dataclass
class RoutingPlan:
    """Where each (token, slot) pair goes. `keep` marks pairs that are computed (first occurrence of
    a valid id in the token); `weight` is the summed weight of every slot with that id."""

    keep: torch.Tensor  # bool [M, K]
    weight: torch.Tensor  # fp32 [M, K]
    expert: torch.Tensor  # int64 [M, K], ids < 0 clamped to 0 (masked by keep)
    pos: torch.Tensor  # int64 [M, K]: index of the token within its expert's rows
    counts: torch.Tensor  # int32 [E]: tokens per expert


def plan_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> RoutingPlan:
    m, k = topk_ids.shape
    ids = topk_ids.long()
    same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [M, K, K]
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)
    keep = (ids >= 0) & ~(same & earlier).any(dim=2)
    weight = (same.float() * topk_weights.float().unsqueeze(1)).sum(dim=2)
    expert = ids.clamp_min(0)
    # presence [M, E+1]: column E collects the dropped pairs
    presence = torch.zeros(m, num_experts + 1, dtype=torch.int64, device=ids.device)
    presence.scatter_(1, torch.where(keep, expert, num_experts), 1)
    presence = presence[:, :num_experts]
    before = presence.cumsum(dim=0) - presence  # tokens of the same expert earlier in the batch
    pos = before.gather(1, expert.clamp_max(num_experts - 1))
    return RoutingPlan(keep, weight, expert, pos, presence.sum(dim=0).to(torch.int32))


def _combine(out_rows: torch.Tensor, row: torch.Tensor, plan: RoutingPlan, dtype: torch.dtype) -> torch.Tensor:
    m, k = plan.keep.shape
    vals = out_rows.index_select(0, row.reshape(-1)).reshape(m, k, -1).float()
    # where, not multiply: rows of dropped pairs may hold anything (unwritten GEMM rows), even NaN
    contrib = torch.where(plan.keep.unsqueeze(-1), vals * plan.weight.unsqueeze(-1), 0.0)
    return contrib.sum(dim=1).to(dtype)


def _situ_bf16(h: torch.Tensor, inter: int, beta: float, lin_beta: float) -> torch.Tensor:
    return situ(h[..., :inter], h[..., inter:], beta, lin_beta).to(h.dtype)


def routed_masked(z, plan, w13, w2, beta, lin_beta, dg) -> torch.Tensor:
    m, latent = z.shape
    num_experts, two_inter, _ = w13.shape
    k = plan.keep.shape[1]
    expected_m = max(1, min(m, math.ceil(m * k / num_experts)))
    sink = num_experts * m  # one extra row takes the dropped pairs' writes
    row = torch.where(plan.keep, plan.expert * m + plan.pos, sink)
    a = torch.empty((sink + 1, latent), dtype=z.dtype, device=z.device)
    a[row.reshape(-1)] = z.repeat_interleave(k, dim=0)
    a = a[:sink].view(num_experts, m, latent)
    h = torch.empty((num_experts, m, two_inter), dtype=z.dtype, device=z.device)
    dg.m_grouped_bf16_gemm_nt_masked(a=a, b=w13, d=h, masked_m=plan.counts, expected_m=expected_m)
    act = _situ_bf16(h, two_inter // 2, beta, lin_beta)
    out = torch.empty((num_experts, m, latent), dtype=z.dtype, device=z.device)
    dg.m_grouped_bf16_gemm_nt_masked(a=act, b=w2, d=out, masked_m=plan.counts, expected_m=expected_m)
    return _combine(out.view(num_experts * m, latent), torch.where(plan.keep, row, 0), plan, z.dtype)


def routed_contiguous(z, plan, w13, w2, beta, lin_beta, dg) -> torch.Tensor:
    m, latent = z.shape
    num_experts, two_inter, _ = w13.shape
    k = plan.keep.shape[1]
    align = int(dg.get_mk_alignment_for_contiguous_layout())
    # Static bound on the padded row count, so no host sync is needed to size the buffers.
    capacity = -(-(m * k + num_experts * (align - 1)) // align) * align
    padded = (plan.counts.long() + align - 1) // align * align
    start = padded.cumsum(0) - padded
    row = torch.where(plan.keep, start[plan.expert] + plan.pos, capacity)
    a = torch.empty((capacity + 1, latent), dtype=z.dtype, device=z.device)
    a[row.reshape(-1)] = z.repeat_interleave(k, dim=0)
    layout = torch.full((capacity + 1,), -1, dtype=torch.int32, device=z.device)
    layout[row.reshape(-1)] = plan.expert.reshape(-1).to(torch.int32)
    layout = layout[:capacity]
    h = torch.empty((capacity, two_inter), dtype=z.dtype, device=z.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(a=a[:capacity], b=w13, d=h, grouped_layout=layout)
    act = _situ_bf16(h, two_inter // 2, beta, lin_beta)
    out = torch.empty((capacity, latent), dtype=z.dtype, device=z.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(a=act, b=w2, d=out, grouped_layout=layout)
    return _combine(out, torch.where(plan.keep, row, 0), plan, z.dtype)


def choose_layout(m: int) -> str:
    forced = os.environ.get(LAYOUT_ENV)
    if forced in ("masked", "contiguous"):
        return forced
    return "masked" if m <= MASKED_MAX_M else "contiguous"


def routed_deepgemm(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta):
    if z.shape[0] == 0:
        return torch.empty_like(z)
    dg = deep_gemm_module()
    w13_bf16, w2_bf16 = bf16_weights(w13, w2, w13_scale, w2_scale, weight_format)
    plan = plan_routing(topk_ids, topk_weights, w13.shape[0])
    run = routed_masked if choose_layout(z.shape[0]) == "masked" else routed_contiguous
    return run(z, plan, w13_bf16, w2_bf16, beta, lin_beta, dg)
