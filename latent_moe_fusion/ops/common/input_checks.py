"""Argument checks for the lmf ops. Every error names the argument and says what was expected."""

from __future__ import annotations

import math

import torch

from .fragment_layouts import MODES, group_size

ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)


class LmfInputError(ValueError):
    """An argument an lmf op cannot accept."""


def _fail(op: str, msg: str) -> None:
    raise LmfInputError(f"lmf::{op}: {msg}")


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


def validate_route_scalars(
    op: str, num_experts: int, top_k: int, renorm_eps: float, scaling_factor: float, first_expert: int,
    num_local: int,
) -> None:
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        _fail(op, f"top_k must be an int in [1, E = {num_experts}], got {top_k!r}")
    if not (isinstance(renorm_eps, (int, float)) and math.isfinite(renorm_eps) and renorm_eps >= 0):
        _fail(op, f"renorm_eps must be a finite number >= 0, got {renorm_eps!r}")
    if not (isinstance(scaling_factor, (int, float)) and math.isfinite(scaling_factor)):
        _fail(op, f"scaling_factor must be a finite number, got {scaling_factor!r}")
    if not isinstance(first_expert, int) or not 0 <= first_expert < num_experts:
        _fail(op, f"first_expert must be an int in [0, E = {num_experts}), got {first_expert!r}")
    if not isinstance(num_local, int) or not 1 <= num_local <= num_experts - first_expert:
        _fail(op, f"num_local must be an int in [1, E - first_expert = {num_experts - first_expert}], got {num_local!r}")
