"""Argument checks for the lmf ops. Every error names the argument and says what was expected."""

from __future__ import annotations

import math

import torch

from .env import env_switch
from .layouts import MODES, fragment_shape, group_size
from .mxfp4 import BLOCK as MXFP4_BLOCK

ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
WEIGHT_FORMATS = ("bf16", "mxfp4")


class LmfInputError(ValueError):
    """An argument an lmf op cannot accept."""


def _fail(op: str, msg: str) -> None:
    raise LmfInputError(f"lmf::{op}: {msg}")


def _is_symbolic_or_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(op, f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        _fail(op, f"{name} must have dtype {names}; got {str(t.dtype).replace('torch.', '')}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device} but the activations are on {device}; move it there")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)}); call .contiguous()")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple, meaning: str) -> None:
    if tuple(t.shape) != tuple(expected):
        _fail(op, f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)} ({meaning})")


def check_positive(op: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        _fail(op, f"{name} must be a finite number > 0, got {value!r}")


CHECK_IDS_ENV = "LMF_CHECK_IDS"


def device_id_check_enabled() -> bool:
    """The id range check reads the ids back: on a GPU that is a host sync per call, which stops the host
    from queueing ahead (prefill outside CUDA graphs). LMF_CHECK_IDS=0 skips it on CUDA tensors (ids
    >= E then index out of bounds inside the kernels: only for routers known to be correct)."""
    return env_switch(CHECK_IDS_ENV, on="check the ids, the default", off="skip the check on CUDA tensors") is not False


def _ids_out_of_range(op: str, top: int, num_experts: int) -> None:
    if top >= num_experts:
        _fail(op, f"topk_ids holds expert id {top} but w13 has only {num_experts} experts (valid: 0..{num_experts - 1}, "
                  "or any id < 0 for an expert not on this rank, which is skipped)")


class DeferredIdCheck:
    """The id range check of CUDA ids without stalling the GPU.

    A synchronous check returns to the host only once the GPU has drained every kernel queued before the
    op; the GPU then idles while the host launches the op's kernels (~0.25 ms per block at M = 4096 on
    the H200, bench/results/host_gaps.md). Here the largest id is copied to pinned host memory behind the
    queued work, the op launches its kernels, and finish() waits for that copy alone: by then the op's
    kernels keep the GPU busy. Only for backends whose kernels skip ids >= E (Backend.bad_ids_safe), so
    that bad ids make them compute garbage the op never returns rather than read out of bounds."""

    def __init__(self, op: str, topk_ids: torch.Tensor, num_experts: int) -> None:
        self.op, self.num_experts = op, num_experts
        self._top = torch.empty((), dtype=topk_ids.dtype, pin_memory=True)
        self._top.copy_(topk_ids.max(), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(topk_ids.device))  # the ids' device, not the current one

    def finish(self) -> None:
        self._copied.synchronize()
        _ids_out_of_range(self.op, int(self._top), self.num_experts)


def check_ids(op: str, topk_ids: torch.Tensor, num_experts: int, defer: bool = False) -> DeferredIdCheck | None:
    """Ids must be < E (negative ids mean 'expert not on this rank'). Reads the data, so it is skipped on
    fake tensors, while a CUDA graph is being captured and on CUDA with LMF_CHECK_IDS=0. On CUDA with
    `defer`, returns a DeferredIdCheck whose finish() the caller runs after launching its kernels."""
    if _is_symbolic_or_fake(topk_ids) or topk_ids.numel() == 0:
        return None
    if topk_ids.is_cuda:
        if torch.cuda.is_current_stream_capturing() or not device_id_check_enabled():
            return None
        if defer:
            return DeferredIdCheck(op, topk_ids, num_experts)
    _ids_out_of_range(op, int(topk_ids.max()), num_experts)
    return None


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


def check_mode_and_group(op: str, mode: str, group_name: str | None) -> int:
    """Returns the number of ranks R that `mode` spans on `group_name`."""
    if mode not in MODES:
        _fail(op, f"mode must be one of {MODES}, got {mode!r}")
    if group_name is not None and not isinstance(group_name, str):
        _fail(op, f"group_name must be a str or None, got {type(group_name).__name__}")
    try:
        world = group_size(group_name)
    except ValueError as exc:  # not initialized, or no group of that name
        _fail(op, str(exc))
    if mode == "local" and world != 1:
        _fail(op, f"mode='local' is for R = 1 but group {group_name!r} has {world} ranks; use 'hidden_scatter' (TP) or 'token_publish' (SP)")
    return world


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


def validate_tail(
    op: str, y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str, group_name: str | None
) -> int:
    """Check latent_tail's arguments; returns R."""
    if not isinstance(y_n, torch.Tensor):
        _fail(op, f"y_n must be a tensor, got {type(y_n).__name__}")
    dev = y_n.device
    check_tensor(op, "y_n", y_n, ndim=2, dtypes=ACTIVATION_DTYPES, device=dev)
    check_tensor(op, "w_up", w_up, ndim=2, dtypes=(y_n.dtype,), device=dev)
    check_tensor(op, "ws", ws, ndim=3, dtypes=(y_n.dtype,), device=dev)
    m, latent = y_n.shape
    hidden = w_up.shape[0]
    check_shape(op, "w_up", w_up, (hidden, latent), "[H, L] with L = y_n.shape[1]")
    world = check_mode_and_group(op, mode, group_name)
    if hidden % world:
        _fail(op, f"w_up has H = {hidden} rows, not divisible by R = {world}")
    expected = fragment_shape(mode, m, hidden, world)
    if tuple(ws.shape) != expected:
        r_axis = 1 if mode == "token_publish" else 0
        if ws.shape[r_axis] != world:
            where = "no group (R = 1)" if group_name is None else f"group {group_name!r} has {world} ranks"
            _fail(op, f"ws holds {ws.shape[r_axis]} fragments along dim {r_axis} but {where}; "
                      f"expected shape {expected} for mode={mode!r}")
        check_shape(op, "ws", ws, expected, f"fragments for mode={mode!r}, R = {world}, M = {m}, H = {hidden}")
    return world
