"""Argument checks of the routed experts and the shared expert (lmf::routed_experts, lmf::moe_shared_producer,
lmf::route_and_produce). Every error names the argument and says what was expected."""

from __future__ import annotations

import torch

from ..common.input_checks import ACTIVATION_DTYPES, _fail, check_positive, check_shape, check_tensor
from ..common.mxfp4 import BLOCK as MXFP4_BLOCK
from .expert_ids_check import check_ids

WEIGHT_FORMATS = ("bf16", "mxfp4")


def validate_routed(
    op: str,
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
    ids: bool = True,
) -> tuple[int, int]:
    """Check the routed-expert arguments; returns (num_experts, moe_intermediate_size). `ids=False` leaves
    the id range to the caller (check_ids), which may defer it past its launches."""
    if not isinstance(z, torch.Tensor):
        _fail(op, f"z must be a tensor, got {type(z).__name__}")
    dev = z.device
    check_tensor(op, "z", z, ndim=2, dtypes=ACTIVATION_DTYPES, device=dev)
    m, latent = z.shape
    check_tensor(op, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), device=dev)
    check_tensor(op, "topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=dev)
    if topk_ids.shape[0] != m:
        _fail(op, f"topk_ids has {topk_ids.shape[0]} rows but z has {m} tokens")
    check_shape(op, "topk_weights", topk_weights, tuple(topk_ids.shape), "same as topk_ids")
    check_positive(op, "beta", beta)
    check_positive(op, "lin_beta", lin_beta)
    if weight_format not in WEIGHT_FORMATS:
        _fail(op, f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "bf16":
        check_tensor(op, "w13", w13, ndim=3, dtypes=(z.dtype,), device=dev)
        check_tensor(op, "w2", w2, ndim=3, dtypes=(z.dtype,), device=dev)
        for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if scale is not None:
                _fail(op, f"{name} must be None for weight_format='bf16'")
        num_experts, two_inter, k13 = w13.shape
        inter = two_inter // 2
        if two_inter % 2:
            _fail(op, f"w13 dim 1 ({two_inter}) must be even: gate rows then up rows")
        check_shape(op, "w13", w13, (num_experts, two_inter, latent), "[E, 2I, L] with L = z.shape[1]")
        check_shape(op, "w2", w2, (num_experts, latent, inter), "[E, L, I]")
    else:
        if latent % MXFP4_BLOCK:
            _fail(op, f"z.shape[1] = {latent} (K of the L1 GEMM) is not divisible by {MXFP4_BLOCK}, which mxfp4 needs")
        check_tensor(op, "w13", w13, ndim=3, dtypes=(torch.uint8,), device=dev)
        check_tensor(op, "w2", w2, ndim=3, dtypes=(torch.uint8,), device=dev)
        for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if scale is None:
                _fail(op, f"{name} is required for weight_format='mxfp4' (uint8 E8M0, one per 32 along K)")
            check_tensor(op, name, scale, ndim=3, dtypes=(torch.uint8,), device=dev)
        num_experts, two_inter, _ = w13.shape
        if two_inter % 2:
            _fail(op, f"w13 dim 1 ({two_inter}) must be even: gate rows then up rows")
        inter = two_inter // 2
        if inter % MXFP4_BLOCK:
            _fail(op, f"w13.shape[1] / 2 = {inter} (I, the K of the L2 GEMM with w2) is not divisible by {MXFP4_BLOCK}, "
                      "which mxfp4 needs")
        check_shape(op, "w13", w13, (num_experts, two_inter, latent // 2), "packed mxfp4 [E, 2I, L/2]")
        check_shape(op, "w13_scale", w13_scale, (num_experts, two_inter, latent // MXFP4_BLOCK), "E8M0 [E, 2I, L/32]")
        check_shape(op, "w2", w2, (num_experts, latent, inter // 2), "packed mxfp4 [E, L, I/2]")
        check_shape(op, "w2_scale", w2_scale, (num_experts, latent, inter // MXFP4_BLOCK), "E8M0 [E, L, I/32]")
    if ids:
        check_ids(op, topk_ids, num_experts)
    return num_experts, inter


def validate_shared(
    op: str,
    x_s: torch.Tensor,
    w1_s: torch.Tensor,
    w3_s: torch.Tensor,
    w2_s: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Check the shared-expert arguments; returns the hidden size H."""
    check_tensor(op, "x_s", x_s, ndim=2, dtypes=(dtype,), device=device)
    hidden = x_s.shape[1]
    check_tensor(op, "w1_s", w1_s, ndim=2, dtypes=(dtype,), device=device)
    inter_s = w1_s.shape[0]
    check_shape(op, "w1_s", w1_s, (inter_s, hidden), "[I_s, H] with H = x_s.shape[1]")
    check_tensor(op, "w3_s", w3_s, ndim=2, dtypes=(dtype,), device=device)
    check_shape(op, "w3_s", w3_s, (inter_s, hidden), "[I_s, H], same as w1_s")
    check_tensor(op, "w2_s", w2_s, ndim=2, dtypes=(dtype,), device=device)
    check_shape(op, "w2_s", w2_s, (hidden, inter_s), "[H, I_s]")
    return hidden


def validate_producer_layout(op: str, m: int, x_s: torch.Tensor, mode: str, world: int, group_name: str | None) -> None:
    m_s, hidden = x_s.shape
    expected = world * m if mode == "token_publish" else m
    if m_s != expected:
        hint = (
            " (for R > 1 pass group_name of the SP group)" if mode == "token_publish" and group_name is None else ""
        )
        _fail(op, f"x_s has {m_s} rows; mode={mode!r} with R = {world} needs {expected} (z has {m} tokens){hint}")
    if hidden % world:
        _fail(op, f"hidden size {hidden} is not divisible by R = {world} for mode={mode!r}")
