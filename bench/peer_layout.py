"""Our MXFP4 expert weights in the layout OpenAI's `triton_kernels` reads on Hopper, set up as vLLM sets it up.

The peer (triton-lang/triton `python/triton_kernels`, tag v3.6.0) is not a package on any index: it is read from a
source folder (`.peer/python/triton_kernels` by default) put on sys.path by `use_triton_kernels`.

Ours, for an expert weight W [N, K]: packed uint8 [E, N, K/2] (element 2j in the low nibble of byte j along K) and
E8M0 scales uint8 [E, N, K/32]; w13 holds the N = 2I gate rows first, then the up rows.
Theirs (vLLM's `_swizzle_mxfp4` on sm_90): W as [E, K, N] quantised along K (mx_axis = 1), the same bytes with the
last two axes swapped (the nibble pairs and the 32-blocks stay along K, so no byte changes), then
`HopperMXValueLayout(mx_axis=1)` and `HopperMXScaleLayout(mx_axis=1, num_warps=8)` shuffle them for the kernel's
loads. Their fused activation reads the L1 output as (gate, up) column pairs, so w13's gate and up rows are
interleaved first (row 2i = gate i, row 2i + 1 = up i), as vLLM's checkpoints for gpt-oss already are.

Only `use_triton_kernels`, `to_peer_layout` and `peer_bytes` touch the peer; the rest is plain torch and is tested
without it.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRITON_KERNELS = ROOT / ".peer" / "python" / "triton_kernels"
TRITON_KERNELS_TAG = "v3.6.0"
TRITON_KERNELS_COMMIT = "7c56a5e40f7fd928dfd5c72902d5def0097db73a"
CHECKOUT = f"triton-lang/triton at tag {TRITON_KERNELS_TAG} (commit {TRITON_KERNELS_COMMIT})"
HOW_TO_GET = f"check out {CHECKOUT} and pass --triton-kernels <checkout>/python/triton_kernels"
HOW_TO_GET_FOR_TESTS = f"check out {CHECKOUT} and copy its python/triton_kernels folder to .peer/python/triton_kernels"
# vLLM's num_warps for the Hopper scale swizzle (and so the matmul's warps: opt_flags reads it from the layout).
HOPPER_SCALE_WARPS = 8
# SHA-256 over the .py files of triton_kernels/ (sorted relative paths and contents) of the v3.6.0 tree: an extracted
# folder has no git metadata, so its sources are what identify it.
KNOWN_SOURCES = {"4e190ab0cd377e95cd4e8a0656b9509e6a85d20aec188771fe03b7f1d44b77e8":
                 f"{TRITON_KERNELS_TAG} ({TRITON_KERNELS_COMMIT})"}


def use_triton_kernels(path: Path | str = DEFAULT_TRITON_KERNELS) -> str | None:
    """Put the peer's source folder on sys.path and import it; None if it imports, else why not (for a message)."""
    path = Path(path).resolve()
    if not (path / "triton_kernels" / "matmul_ogs.py").is_file():
        return f"no triton_kernels source at {path}"
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        import triton_kernels.matmul_ogs  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported to the user, who fixes the checkout
        return f"triton_kernels at {path} does not import: {exc!r}"
    loaded = Path(sys.modules["triton_kernels"].__file__).resolve().parent.parent
    if loaded != path:
        return f"a different triton_kernels is already imported (from {loaded}); run with only {path}"
    return None


def source_fingerprint(path: Path | str = DEFAULT_TRITON_KERNELS) -> dict[str, str]:
    """Which triton_kernels ran: its path, the SHA-256 of its sources and, where that hash is the v3.6.0 tree's, the
    tag and commit (an extracted folder carries no commit of its own)."""
    path = Path(path).resolve()
    digest = hashlib.sha256()
    for file in sorted((path / "triton_kernels").rglob("*.py")):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(file.read_bytes())
    sha = digest.hexdigest()
    known = KNOWN_SOURCES.get(sha)
    return {"path": str(path), "sources_sha256": sha,
            "version": known or f"unknown (sources differ from {TRITON_KERNELS_TAG}'s)"}


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] gate rows then up rows -> [E, 2I, ...] with row 2i = gate i and row 2i + 1 = up i (for packed
    values and for scales alike: each row's bytes move whole)."""
    experts, two_inter = t.shape[:2]
    if two_inter % 2:
        raise ValueError(f"interleave_gate_up: dim 1 ({two_inter}) must be even: gate rows then up rows")
    halves = t.reshape(experts, 2, two_inter // 2, *t.shape[2:])
    return halves.transpose(1, 2).reshape(t.shape).contiguous()


def to_kn(t: torch.Tensor) -> torch.Tensor:
    """Ours [E, N, K*] -> theirs [E, K*, N] (a view): the axis that holds the nibble pairs and the 32-blocks (K) is
    dim 1, their mx_axis."""
    return t.transpose(-2, -1)


@dataclass(frozen=True)
class PeerWeights:
    """One rank's experts in the peer's layout: what matmul_ogs takes as w and as precision_config."""

    w13: Any  # triton_kernels.tensor.Tensor [E, L, 2I] (gate/up columns interleaved)
    w2: Any  # triton_kernels.tensor.Tensor [E, I, L]
    w13_precision: Any  # triton_kernels.matmul_ogs.PrecisionConfig holding w13's swizzled scales
    w2_precision: Any
    num_experts: int
    latent: int
    inter: int


def _swizzled(values: torch.Tensor, scales: torch.Tensor) -> tuple[Any, Any]:
    """Ours [E, N, K/2] + [E, N, K/32] -> their Hopper value and scale tensors over [E, K, N]."""
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    value = convert_layout(wrap_torch_tensor(to_kn(values), dtype=FP4), HopperMXValueLayout, mx_axis=1)
    scale = convert_layout(wrap_torch_tensor(to_kn(scales)), HopperMXScaleLayout, mx_axis=1,
                           num_warps=HOPPER_SCALE_WARPS)
    return value, scale


def to_peer_layout(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor) -> PeerWeights:
    """Our MXFP4 w13 [E, 2I, L/2] (+ scales [E, 2I, L/32]) and w2 [E, L, I/2] (+ [E, L, I/32]) -> PeerWeights, as vLLM's
    sm_90 path lays out gpt-oss's experts: gate/up interleaved, [E, K, N], Hopper value and scale swizzles, the
    scales in a PrecisionConfig with a unit flex context (vLLM's `InFlexData()`). Needs `use_triton_kernels` first."""
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from triton_kernels.numerics import InFlexData

    for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
        if t.dtype != torch.uint8 or t.dim() != 3:
            raise ValueError(f"to_peer_layout: {name} must be uint8 [E, N, K*], got {t.dtype} {tuple(t.shape)}")
    num_experts, two_inter, half_latent = w13.shape
    w13_t, w13_s = _swizzled(interleave_gate_up(w13), interleave_gate_up(w13_scale))
    w2_t, w2_s = _swizzled(w2, w2_scale)
    return PeerWeights(
        w13=w13_t, w2=w2_t,
        w13_precision=PrecisionConfig(weight_scale=w13_s, flex_ctx=FlexCtx(rhs_data=InFlexData())),
        w2_precision=PrecisionConfig(weight_scale=w2_s, flex_ctx=FlexCtx(rhs_data=InFlexData())),
        num_experts=num_experts, latent=half_latent * 2, inter=two_inter // 2,
    )


def peer_bytes(t: Any) -> torch.Tensor:
    """A swizzled peer tensor back to plain [E, K*, N] bytes with their own unswizzle (for checks: what their
    `upcast_from_mxfp_torch(values, scales, dtype, axis=1)` decodes). Their scale unswizzle keeps the swizzle's
    padding of N to 2 * num_warps * 2 * 8 rows; it is cut to the logical shape here."""
    plain = t.storage.layout.unswizzle_data(t.storage.data)
    return plain[..., : t.shape[-2], : t.shape[-1]]  # values: already [E, K/2, N] (K/2 < K, the first cut is a no-op)
