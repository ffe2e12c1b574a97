"""Triton backend of lmf::routed_experts (CUDA): device-side grouping, grouped L1 (+SiTU) and L2
GEMMs over BF16 or MXFP4 weights, FP32 top-k combine in slot order. See expert_schedule.py."""

from __future__ import annotations

import torch

from ..common.backends import Backend, Reason, register_backend
from ..common.element_offsets import INT32_MAX
from ..common.mxfp4 import BLOCK as MXFP4_BLOCK
from ..common.triton_support import triton_available
from .expert_schedule import run_experts

MAX_TOP_K = 64  # the combine unrolls the slot loop
MAX_LATENT = 16384  # the combine keeps one row of L in registers


def routed_size_reason(z: torch.Tensor, topk_ids: torch.Tensor, w2: torch.Tensor, weight_format: str) -> Reason:
    """Why the Triton kernels cannot take these routed sizes (None if they can)."""
    m, latent = z.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[-1] * (2 if weight_format == "mxfp4" else 1)
    step = MXFP4_BLOCK if weight_format == "mxfp4" else 16
    if latent % step or inter % step:
        return f"L = {latent} and I = {inter} must be multiples of {step} (the K tile of the expert GEMMs)"
    if top_k > MAX_TOP_K:
        return f"top_k = {top_k} > {MAX_TOP_K} (the combine unrolls the slots)"
    if latent > MAX_LATENT:
        return f"L = {latent} > {MAX_LATENT} (the combine holds one row in registers)"
    # Rows past int32 element offsets are no limit: the kernels that run at prefill sizes address them in int64 (the
    # Gluon kernels and the combine always, the Triton grids under LARGE_OFFSETS; ops/common/element_offsets.py).
    # The grouping's row and pair indices themselves are int32.
    rows = m * top_k + min(w2.shape[0], m * top_k) * 128  # grouped rows incl. padding, largest block
    if rows > INT32_MAX:
        return f"M * top_k = {m * top_k} pairs: {rows} grouped rows pass the grouping's int32 indices; split the batch"
    return None


def _supports(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta) -> Reason:
    return routed_size_reason(z, topk_ids, w2, weight_format)


# run_experts takes the op's ten arguments positionally (its extra ones are the producer's).
register_backend(
    Backend("routed_experts", "triton", 10, ("cuda",), run_experts, triton_available, _supports,
            bad_ids_safe=True)  # grouping skips ids >= E; the combine reads pair rows by slot
)
