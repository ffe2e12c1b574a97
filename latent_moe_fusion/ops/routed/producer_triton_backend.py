"""Triton backend of lmf::moe_shared_producer (CUDA).

Routed experts and the shared expert share the grouped launches (the shared expert is one more
'expert' over all tokens in the L1 and L2 grids), the RMSNorm is fused into the combine: four
launches in all (expert_schedule.py). On one rank every layout is the [M, H] shared output itself
(local [1, M, H], token_publish [M, 1, H], hidden_scatter [1, M, H]), so the L2 launch writes the
fragments in place; for R > 1 the partial [M_s, H] is moved by layouts.start_publish, right after library
shared GEMMs (beside the routed experts) where they run.
"""

from __future__ import annotations

import torch

from ..common.backends import Backend, Reason, register_backend
from ..common.fragment_layouts import PendingFragments, fragment_buffers, fragment_shape, group_size, start_publish
from ..common.triton_support import triton_available
from .expert_schedule import SharedExpert, run_experts
from .expert_triton_backend import routed_size_reason


def _supports(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name,
) -> Reason:
    reason = routed_size_reason(z, topk_ids, w2, weight_format)
    if reason is not None:
        return reason
    hidden, inter_s = x_s.shape[1], w1_s.shape[0]
    step = 32 if weight_format == "mxfp4" else 16
    if hidden % step or inter_s % step:
        return f"H = {hidden} and I_s = {inter_s} must be multiples of {step} (K tiles shared with the routed GEMMs)"
    return None  # x_s rows past int32 offsets: the Triton grids' shared tiles take them under LARGE_OFFSETS


def moe_shared_producer_triton(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name,
) -> tuple[torch.Tensor, torch.Tensor]:
    world = group_size(group_name)
    m_s, hidden = x_s.shape
    if world == 1:
        ws = x_s.new_empty(fragment_shape(mode, z.shape[0], hidden, 1))
        s_out = ws.view(m_s, hidden)
    else:
        s_out = x_s.new_empty(m_s, hidden)
    # R > 1: where the shared expert runs as library GEMMs, its fragments go out right after them, beside the
    # routed experts (buffers made on this stream, which waits for the exchange before returning); elsewhere
    # (shared tiles inside the routed grids) after everything.
    buffers = fragment_buffers(m_s, hidden, mode, world, x_s, group_name) if world > 1 else None
    published: list[PendingFragments] = []

    def publish() -> None:
        published.append(start_publish(s_out, mode, group_name, buffers))

    y_n = run_experts(
        z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
        rms_weight=rms_weight, eps=eps,
        shared=SharedExpert(x_s, w1_s, w3_s, w2_s, s_out, on_done=publish if world > 1 else None),
    )
    if world > 1:
        ws = (published[0] if published else start_publish(s_out, mode, group_name, buffers)).wait()
    return y_n, ws


register_backend(
    Backend("moe_shared_producer", "triton", 10, ("cuda",), moe_shared_producer_triton, triton_available, _supports,
            bad_ids_safe=True)  # grouping skips ids >= E; the combine reads pair rows by slot
)
