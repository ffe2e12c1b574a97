"""What Hopper serving runs today for one rank's Kimi K3 block: a baseline column for bench/block.py.

    from bench.serving_baseline import serving_block
    serve = serving_block(block)   # block: lmf.KimiK3MoEBlock, MXFP4 experts, on an sm_90 GPU
    out = serve(x)                 # x [M, H] -> [M, H], as block(x)

The routed experts run on OpenAI's triton_kernels MXFP4 MoE set up as vLLM sets it up (bench/peer_moe.py; weights
converted once, routing data built per call); everything else (router, latent down-projection, RMSNorm,
up-projection, shared expert, add) is the block's own code compiled by torch.compile without our pass, so Inductor
fuses only its usual pointwise chains and the matmuls stay cuBLAS, unfused. The peer sits in the compiled graph as
one opaque op, `lmf_peer::routed_experts`, with a fake impl (Dynamo never traces into triton_kernels' Python), as
vLLM registers its MoE layer as a custom op; the op finds the rank's converted weights by an integer handle, as
vLLM finds a layer by name.

In bench/block.py, as one more variant beside "compiled" (same block, same inputs, same timing):

    variants["serving"] = (serving_block(block), None)

Import this module as `bench.serving_baseline` (the op is defined once per process; a second copy of the module under
another name would define nothing and say so).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import latent_moe_fusion as lmf
from latent_moe_fusion.model.router import localize_ids, route

RoutedFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (z, ids, weights) -> y
_ROUTED: dict[int, RoutedFn] = {}  # handle -> the routed experts of one block


def _op_defined() -> bool:
    try:
        torch.ops.lmf_peer.routed_experts  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def _routed(z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int) -> torch.Tensor:
    return _ROUTED[handle](z, topk_ids, topk_weights)


def _routed_fake(z, topk_ids, topk_weights, handle):
    return z.new_empty(z.shape)


if _op_defined():
    raise ImportError("lmf_peer::routed_experts is already defined: bench/serving_baseline.py was imported under a "
                      "second module name; import it as bench.serving_baseline only")
_LIB = torch.library.Library("lmf_peer", "DEF")  # module-level: the op lives as long as the process
_LIB.define("routed_experts(Tensor z, Tensor topk_ids, Tensor topk_weights, int handle) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIB.impl("routed_experts", _routed, _key)
_LIB.impl("routed_experts", torch.library.fallthrough_kernel, "Autograd")  # inference only, like lmf's ops
torch.library.register_fake("lmf_peer::routed_experts", _routed_fake, lib=_LIB)


class _PeerRoutedBlock(lmf.KimiK3MoEBlock):
    """The block with its routed experts' call sent to lmf_peer::routed_experts; everything else is the block's own
    forward. Made by `serving_block` from an existing block (shares its parameters), never constructed."""

    _peer_handle: int

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        # KimiK3MoEBlock.routed with the last call changed (tests/test_peer_layout.py checks they agree)
        cfg = self.cfg
        ids, weights = route(x, self.gate_weight, self.correction_bias, cfg.top_k, cfg.routed_scaling_factor,
                             self.router_gemm)
        if self.ep_size > 1:
            ids = localize_ids(ids, self.first_expert, self.num_local_experts)
        z = F.linear(x, self.w_down)
        return torch.ops.lmf_peer.routed_experts(z, ids, weights, self._peer_handle)


def peer_routed(block: lmf.KimiK3MoEBlock, triton_kernels: Path | str | None = None) -> RoutedFn:
    """The block's MXFP4 routed experts on the peer (vLLM's settings)."""
    from bench.peer_layout import DEFAULT_TRITON_KERNELS, HOW_TO_GET, use_triton_kernels

    if block.weight_format != "mxfp4" or block.w_down.dtype != torch.bfloat16:
        raise ValueError("the peer is triton_kernels' MXFP4 MoE on BF16 activations; this block has "
                         f"{block.weight_format} experts and {block.w_down.dtype} activations")
    missing = use_triton_kernels(DEFAULT_TRITON_KERNELS if triton_kernels is None else triton_kernels)
    if missing:
        raise RuntimeError(f"{missing}: {HOW_TO_GET}")
    from bench.peer_moe import PeerRoutedExperts

    cfg = block.cfg
    return PeerRoutedExperts(block.w13.data, block.w13_scale.data, block.w2.data, block.w2_scale.data,
                             cfg.situ_beta, cfg.situ_linear_beta)


def serving_block(block: lmf.KimiK3MoEBlock, *, triton_kernels: Path | str | None = None,
                  routed: RoutedFn | None = None, compiled: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the block's output as Hopper serving computes it today (module docstring).

    The returned callable shares the block's parameters (plus one converted copy of its experts for the peer) and
    keeps them alive. triton_kernels: the peer's source folder (default .peer/python/triton_kernels).
    routed: another (z, ids, weights) -> y in place of the peer (tests use the reference op on the CPU).
    compiled=False returns the uncompiled module (eager, for checks)."""
    peer_block = copy.copy(block)  # a shallow copy: same parameter tensors, its own module bookkeeping below
    for name in ("_parameters", "_buffers", "_modules"):
        entries = getattr(block, name)
        setattr(peer_block, name, type(entries)(entries))
    peer_block.__class__ = _PeerRoutedBlock
    handle = len(_ROUTED)
    _ROUTED[handle] = routed if routed is not None else peer_routed(block, triton_kernels)
    peer_block._peer_handle = handle
    return torch.compile(peer_block, dynamic=False) if compiled else peer_block
