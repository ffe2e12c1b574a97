"""The expert id range check of the routed ops (topk_ids < E): synchronous, or on CUDA deferred past the op's
launches (DeferredIdCheck)."""

from __future__ import annotations

import torch

from latent_moe_fusion import envs

from ..common.input_checks import _fail


def _is_symbolic_or_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


CHECK_IDS_ENV = "LMF_CHECK_IDS"


def device_id_check_enabled() -> bool:
    """The id range check reads the ids back: on a GPU that is a host sync per call, which stops the host
    from queueing ahead (prefill outside CUDA graphs). LMF_CHECK_IDS=0 skips it on CUDA tensors (ids
    >= E then index out of bounds inside the kernels: only for routers known to be correct)."""
    return envs.read(CHECK_IDS_ENV)


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
