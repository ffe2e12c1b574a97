"""Argument checks of lmf::latent_tail. Every error names the argument and says what was expected."""

from __future__ import annotations

import torch

from ..common.fragment_layouts import fragment_shape
from ..common.input_checks import ACTIVATION_DTYPES, _fail, check_mode_and_group, check_shape, check_tensor


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
