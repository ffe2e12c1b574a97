"""Triton backend of `lmf::latent_tail` (registered at import): every fragment layout onto the tail kernel's launcher
(common/tail_gemm/tail_launch.py, which the down-projection shares)."""

from __future__ import annotations

import torch

from ...common.backends import Backend, register_backend
from ...common.device_capability import current_capability
from ...common.fragment_layouts import gather_columns, rank_tail_operands
from ...common.tail_gemm.tail_launch import _IMPORT_ERROR, launch_reason, tail_fused

NAME = "triton"


def tail_triton(y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str, group_name: str | None):
    """The lmf::latent_tail backend: every layout onto tail_fused."""
    y, w, frags = rank_tail_operands(y_n, w_up, ws, mode, group_name)
    out = tail_fused(y, w, frags)
    return gather_columns(out, group_name) if mode == "hidden_scatter" else out


def available() -> str | None:
    return available_on(current_capability())


def available_on(capability: tuple[int, int] | None) -> str | None:
    """available() on a device of this capability (None: no CUDA device)."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if capability is None:
        return "no CUDA device"
    major, minor = capability
    if major < 9:
        return f"the tail configs are measured on Hopper (sm_90); this device is sm_{major}{minor}"
    return None


def supports(y_n, w_up, ws, mode, group_name=None) -> str | None:
    if y_n.dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {y_n.dtype} is not served (bfloat16 or float32)"
    # What the launcher will do for this rank's operands (its config, split-K workspace and counters): no size limit
    # of its own, since tensors past int32 offsets get the kernels' int64 offsets.
    return launch_reason(*rank_tail_operands(y_n, w_up, ws, mode, group_name))


register_backend(
    Backend(
        op="latent_tail",
        name=NAME,
        priority=10,
        device_types=("cuda",),
        fn=tail_triton,
        available=available,
        supports=supports,
    )
)
