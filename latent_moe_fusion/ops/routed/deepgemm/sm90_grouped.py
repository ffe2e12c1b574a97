"""lmf::routed_experts through DeepGEMM's BF16 M-grouped GEMMs (sm_90), opt-in until measured faster.

API mapped (deepseek-ai/DeepGEMM, csrc/apis/gemm.hpp and csrc/jit_kernels/impls/sm90_bf16_gemm.hpp
at commit 54e2261; the fork keeps them unchanged):

  m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims='nk')
      a [G, M_max, K] bf16, b [G, N, K] bf16, d [G, M_max, N] bf16 (rows >= masked_m[g] untouched),
      masked_m int32 [G], expected_m > 0 a hint; sm_90 needs K % 64 == 0, and M_max a multiple of
      its M tile (not checked by DeepGEMM; see masked_rows).
  m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims='nk',
      use_psum_layout=False, ensure_zero_padding=True, expected_m_for_psum_layout=None)
      a [M, K] bf16 rows grouped by expert, each group padded to get_mk_alignment_for_contiguous_layout()
      rows, grouped_layout int32 [M] = group of each row, -1 on padding rows; d [M, N] bf16.

Mapping: ids/weights -> a routing plan built on the device without host synchronisation (so it can
be captured in a CUDA graph): duplicate ids within a token are merged (their weights summed,
exactly what the contract's sum over slots gives), ids < 0 dropped. Decode sizes use the masked
layout (A is [E, M rounded up to 128, L]); larger M the contiguous one. L1 [2I rows: gate then up] -> SiTU in FP32
(one Triton pass over the rows that hold tokens) -> BF16 -> L2 -> weighted FP32 sum over the top-k -> BF16.

Numerics: DeepGEMM's grouped GEMMs write BF16 only, so h = z @ W13^T and each expert's L2 output
are rounded to BF16 before SiTU / the weighted sum, where the contract keeps them in FP32. The
difference is one BF16 rounding (relative error ~2**-9 per element); tests use a looser bound.
MXFP4 weights are dequantized to BF16 once per weight version (cached): exact, but 4x the bytes.
There is no FP8 weight format in the op contract, so DeepGEMM's FP8 grouped variants are not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from latent_moe_fusion import tuning

from ...common.backends import forced_backend_name
from ...common.mxfp4 import dequantize_mxfp4
from ..situ_rows import situ_rows
from .agree import current_answer
from .probe import SM90_GROUPED, deep_gemm_module
from .weight_cache import WeightCache

NAME = "deepgemm"
LAYOUTS = ("masked", "contiguous")
LAYOUT_OVERRIDE = "deepgemm_routed_layout"  # tuning override: one of LAYOUTS (default: by M)
MASKED_MAX_M = 128
MASKED_M_ALIGN = 128  # rows per group of the masked buffers are a multiple of this (see masked_rows)
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


def masked_rows(m: int) -> int:
    """Rows per group of the masked buffers. DeepGEMM's sm_90 masked kernel addresses A and D as
    [G * rows, .] with TMA tiles of 64 or 128 rows and no host check that rows is a multiple of the
    tile, so with fewer rows a group's tile reads and writes its neighbours' rows (seen on the H200:
    relative error ~1 at M = 1..32, correct at M = 128). Round up to the largest tile it may pick."""
    return -(-m // MASKED_M_ALIGN) * MASKED_M_ALIGN


def stage_masked(z: torch.Tensor, plan: RoutingPlan, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scatter each kept (token, slot) pair's row of z into its expert's group: a [E, rows, L], the
    flat row of every pair in a (a sink row past the end for dropped pairs), and DeepGEMM's expected_m."""
    m, latent = z.shape
    k = plan.keep.shape[1]
    rows = masked_rows(m)
    expected_m = max(1, min(m, math.ceil(m * k / num_experts)))
    sink = num_experts * rows  # one extra row takes the dropped pairs' writes
    row = torch.where(plan.keep, plan.expert * rows + plan.pos, sink)
    a = torch.empty((sink + 1, latent), dtype=z.dtype, device=z.device)
    a[row.reshape(-1)] = z.repeat_interleave(k, dim=0)
    return a[:sink].view(num_experts, rows, latent), row, expected_m


def masked_gemms(a, counts, expected_m, w13, w2, beta, lin_beta, dg) -> torch.Tensor:
    """L1 -> SiTU -> L2 over the masked groups; rows >= counts[g] of the result are not written."""
    num_experts, rows, latent = a.shape
    two_inter = w13.shape[1]
    h = torch.empty((num_experts, rows, two_inter), dtype=a.dtype, device=a.device)
    dg.m_grouped_bf16_gemm_nt_masked(a=a, b=w13, d=h, masked_m=counts, expected_m=expected_m)
    act = situ_rows(h, beta, lin_beta, masked_counts=counts)
    out = torch.empty((num_experts, rows, latent), dtype=a.dtype, device=a.device)
    dg.m_grouped_bf16_gemm_nt_masked(a=act, b=w2, d=out, masked_m=counts, expected_m=expected_m)
    return out


def routed_masked(z, plan, w13, w2, beta, lin_beta, dg) -> torch.Tensor:
    a, row, expected_m = stage_masked(z, plan, w13.shape[0])
    out = masked_gemms(a, plan.counts, expected_m, w13, w2, beta, lin_beta, dg)
    return _combine(out.view(-1, z.shape[1]), torch.where(plan.keep, row, 0), plan, z.dtype)


def stage_contiguous(z: torch.Tensor, plan: RoutingPlan, num_experts: int, align: int):
    """Rows of z grouped by expert, each group padded to `align` rows: a [capacity, L], the
    grouped_layout (expert of each row, -1 on padding) and the row of every pair."""
    m, latent = z.shape
    k = plan.keep.shape[1]
    # Static bound on the padded row count, so no host sync is needed to size the buffers.
    capacity = -(-(m * k + num_experts * (align - 1)) // align) * align
    padded = (plan.counts.long() + align - 1) // align * align
    start = padded.cumsum(0) - padded
    row = torch.where(plan.keep, start[plan.expert] + plan.pos, capacity)
    a = torch.empty((capacity + 1, latent), dtype=z.dtype, device=z.device)
    a[row.reshape(-1)] = z.repeat_interleave(k, dim=0)
    layout = torch.full((capacity + 1,), -1, dtype=torch.int32, device=z.device)
    layout[row.reshape(-1)] = plan.expert.reshape(-1).to(torch.int32)
    return a[:capacity], layout[:capacity], row


def contiguous_gemms(a, layout, w13, w2, beta, lin_beta, dg) -> torch.Tensor:
    capacity, latent = a.shape
    two_inter = w13.shape[1]
    h = torch.empty((capacity, two_inter), dtype=a.dtype, device=a.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(a=a, b=w13, d=h, grouped_layout=layout)
    act = situ_rows(h, beta, lin_beta, grouped_layout=layout)
    out = torch.empty((capacity, latent), dtype=a.dtype, device=a.device)
    dg.m_grouped_bf16_gemm_nt_contiguous(a=act, b=w2, d=out, grouped_layout=layout)
    return out


def routed_contiguous(z, plan, w13, w2, beta, lin_beta, dg) -> torch.Tensor:
    align = int(dg.get_mk_alignment_for_contiguous_layout())
    a, layout, row = stage_contiguous(z, plan, w13.shape[0], align)
    out = contiguous_gemms(a, layout, w13, w2, beta, lin_beta, dg)
    return _combine(out, torch.where(plan.keep, row, 0), plan, z.dtype)


tuning.register(LAYOUT_OVERRIDE, tuning.choice(LAYOUTS, "the layout of DeepGEMM's M-grouped GEMMs"))


def choose_layout(m: int) -> str:
    forced = tuning.current().deepgemm_routed_layout
    if forced is not None:
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
