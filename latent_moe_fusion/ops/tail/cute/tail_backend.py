"""The `cute` backend of `lmf::latent_tail` (registered at import; cutlass is imported only when it runs).

Where it runs is decided per M bucket by a measured table shipped with the package, tail_choice.json beside this
file (bench/tail_cute.py --install-choice writes it from a side-by-side run against the Triton tail; the run's record
is bench/results/tail_cute_choice.json, and a test keeps the two equal): a bucket whose entry is not "cute", or a
missing table, leaves the op to Triton. `LMF_BACKEND_LATENT_TAIL=cute`
forces it wherever the shapes are supported. The choice depends only on the installation, the
table file, M, the dtype and the shapes, so every rank of a group makes the same one.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from pathlib import Path

import torch

from latent_moe_fusion import tuning

from ...common.backends import Backend, forced_backend_name, register_backend
from ...common.device_capability import current_capability
from ...common.element_offsets import INT32_MAX, beyond_int32_reason
from ...common.fragment_layouts import gather_columns, rank_tail_operands
from .tail_configs import HIDDEN_MULTIPLE, TILE_K, VEC, bucket_bound

OP = "latent_tail"
NAME = "cute"
CHOICE_OVERRIDE = "cute_tail_choice"  # tuning override: the path of another choice table (tests, new measurements)
# Package data (pyproject.toml), so that an installed wheel chooses as the checkout does.
DEFAULT_CHOICE = Path(__file__).resolve().with_name("tail_choice.json")


@functools.cache
def _load_choice(path: str, required: bool = False) -> dict[int, str]:
    """{bucket bound: backend name}; empty when the file is absent (Triton keeps every bucket), unless `required`:
    a table named by CHOICE_OVERRIDE must exist, since a mistyped path would hand every bucket to Triton without a
    word."""
    p = Path(path)
    if not p.is_file():
        if required:
            _missing(path)
        return {}
    data = json.loads(p.read_text())
    return {int(bound): str(name) for bound, name in data.get("choice", {}).items()}


def _missing(path: str) -> None:
    raise ValueError(f"{CHOICE_OVERRIDE}={path!r}: no such file; name a choice table written by bench/tail_cute.py "
                     "(JSON with a 'choice' of bucket bound -> 'cute' or 'triton'), or None for the shipped one")


def _choice_path(name: str, value: str | os.PathLike) -> str:
    path = os.fspath(value)
    if not Path(path).is_file():
        _missing(path)
    return path


tuning.register(CHOICE_OVERRIDE, _choice_path)


def measured_choice() -> dict[int, str]:
    """The shipped table, or the one the cute_tail_choice override names."""
    given = tuning.current().cute_tail_choice
    return _load_choice(given, required=True) if given else _load_choice(str(DEFAULT_CHOICE))


NOT_INSTALLED = "nvidia-cutlass-dsl is not installed (pip install 'latent-moe-fusion[cute]')"


@functools.cache
def installed() -> bool:
    """Whether the CuTe DSL (nvidia-cutlass-dsl) is installed in this environment."""
    try:
        importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def available() -> str | None:
    return available_on(current_capability(), installed())


def available_on(capability: tuple[int, int] | None, cute_installed: bool) -> str | None:
    """available() on a device of this capability (None: no CUDA device), with or without the CuTe DSL."""
    if not cute_installed:
        return NOT_INSTALLED
    if capability is None:
        return "no CUDA device"
    major, minor = capability
    if (major, minor) != (9, 0):
        return f"the CuTe tail kernel is built for sm_90a (WGMMA); this device is sm_{major}{minor}"
    return None


def _aligned(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    return t.data_ptr() % 16 == 0 and all(s % VEC == 0 for s in strides)


def shape_reason(y: torch.Tensor, w: torch.Tensor, frags: torch.Tensor) -> str | None:
    """Why the kernel cannot take y [M, K], w [N, K] (this rank's rows), frags [R, M, N]; None if it can."""
    from .tail_runtime import SUPPORTED_DTYPES

    if y.dtype not in SUPPORTED_DTYPES:
        return f"dtype {y.dtype} is not served (bfloat16 or float16)"
    m, k = y.shape
    n = w.shape[0]
    if k % TILE_K:
        return f"y_n has L = {k} columns, not a multiple of {TILE_K}"
    if n % HIDDEN_MULTIPLE:
        return f"this rank's hidden width {n} is not a multiple of {HIDDEN_MULTIPLE}"
    if y.stride(1) != 1 or not _aligned(y, (y.stride(0),)):
        return "y_n must be row-major with 16-byte aligned base and row stride"
    if w.stride(1) != 1 or not _aligned(w, (w.stride(0),)):
        return "w_up must be row-major with 16-byte aligned base and row stride"
    if frags.stride(2) != 1 or not _aligned(frags, frags.stride()[:2]):
        return "ws must be contiguous along H with 16-byte aligned base and strides"
    # The kernel's layouts index in int32 (M, N, K and the strides are Int32 run-time arguments); the Triton tail
    # takes larger tensors.
    named = (("y_n", y), ("w_up", w), ("ws as [R, M, N]", frags))
    for name, t in named:
        if max(t.stride()) > INT32_MAX:
            return f"{name} has a stride of {max(t.stride())}, beyond the CuTe tail's Int32 strides (at most {INT32_MAX})"
    layouts = {name: (t.shape, t.stride()) for name, t in named} | {"out": ((m, n), (n, 1))}
    return beyond_int32_reason("CuTe tail; the Triton tail takes it", layouts)


def supports(y_n, w_up, ws, mode, group_name=None) -> str | None:
    return rank_supports(*rank_tail_operands(y_n, w_up, ws, mode, group_name))


def rank_supports(y: torch.Tensor, w: torch.Tensor, frags: torch.Tensor) -> str | None:
    """supports() on this rank's operands (fragment_layouts.rank_tail_operands): the shapes, then the measured
    table's bucket unless LMF_BACKEND_LATENT_TAIL=cute forces it."""
    reason = shape_reason(y, w, frags)
    if reason is not None or forced_backend_name(OP) == NAME:
        return reason
    bound = bucket_bound(y.shape[0])
    if measured_choice().get(bound) != NAME:
        return (f"the measured table ({DEFAULT_CHOICE.name}) does not pick cute for the M <= {bound} bucket; "
                "Triton serves it (LMF_BACKEND_LATENT_TAIL=cute forces cute)")
    return None


def tail_cute(y_n, w_up, ws, mode, group_name=None) -> torch.Tensor:
    from .tail_runtime import tail_cute_fused

    y, w, frags = rank_tail_operands(y_n, w_up, ws, mode, group_name)
    out = tail_cute_fused(y, w, frags)
    return gather_columns(out, group_name) if mode == "hidden_scatter" else out


register_backend(
    Backend(
        op=OP,
        name=NAME,
        priority=5,  # ahead of Triton (10), but only in the buckets the measured table gives it
        device_types=("cuda",),
        fn=tail_cute,
        available=available,
        supports=supports,
    )
)
