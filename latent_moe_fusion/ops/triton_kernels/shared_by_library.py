"""The shared expert as library (cuBLAS) GEMMs, for producers whose routed grid runs without it.

Same roundings as the unfused block: BF16 GEMM outputs with FP32 accumulation, SiTU in FP32 rounded
to BF16, the down product written straight into the fragment buffer. A merged [2 I_s, H] gate/up
parameter arrives as two row-block views; when the views are adjacent in one storage they run as one
GEMM, like the unfused block's merged matmul, and the SiTU is one Triton pass over both halves.

LMF_SHARED_GEMMS=cublas|triton (read per call; unset: cublas) runs the two GEMMs, at decode sizes (up to 32
tokens, bf16, Hopper), on the tail's Triton swap-AB kernel with no fragments instead: the same roundings
in another FP32 summation order (not bitwise cuBLAS), fewer CTAs beside the routed chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import capability
from ..env import env_choice
from .situ_rows import situ_pair

SHARED_GEMMS_ENV = "LMF_SHARED_GEMMS"
SHARED_GEMMS_CHOICES = ("cublas", "triton")
DEFAULT_SHARED_GEMMS = "cublas"


def _swap_config(x: torch.Tensor, n: int):
    """The tail table's swap-AB config for x @ w^T ([M, K] x [N, K]) where LMF_SHARED_GEMMS asks for Triton and
    the table has one (bf16, Hopper, decode sizes), else None (cuBLAS)."""
    choice = env_choice(SHARED_GEMMS_ENV, SHARED_GEMMS_CHOICES, "the shared expert's GEMMs") or DEFAULT_SHARED_GEMMS
    if choice != "triton" or not x.is_cuda or x.dtype != torch.bfloat16 or capability(x.device.index)[0] != 9:
        return None
    from .tail import _num_sms
    from .tail_configs import pick_config

    cfg = pick_config(x.shape[0], n, x.shape[1], False, _num_sms(x.device))
    return cfg if cfg.kernel in ("swap", "swap_tma") and cfg.block_m >= x.shape[0] else None


def _linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """round(x @ w^T) into out (new if None): cuBLAS, or the swap-AB kernel where _swap_config gives one."""
    cfg = _swap_config(x, w.shape[0])
    if cfg is None:
        return F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)
    from .tail import tail_fused

    if out is None:
        out = x.new_empty(x.shape[0], w.shape[0])
    no_fragments = x.new_empty((0, x.shape[0], w.shape[0]))
    return tail_fused(x, w, no_fragments, out, cfg, pdl=False, counter_user="shared_expert")


def merged_rows(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor | None:
    """[top; bottom] as one view when bottom's rows directly follow top's in the same storage with the
    same row-major strides (two row blocks of one parameter), else None."""
    if top.dim() != 2 or bottom.dim() != 2 or top.shape[1] != bottom.shape[1]:
        return None
    if top.dtype != bottom.dtype or top.device != bottom.device or top.stride() != bottom.stride():
        return None
    if top.stride(1) != 1 or top.stride(0) < top.shape[1]:
        return None
    if top.untyped_storage().data_ptr() != bottom.untyped_storage().data_ptr():
        return None
    if bottom.storage_offset() != top.storage_offset() + top.shape[0] * top.stride(0):
        return None
    return top.as_strided((top.shape[0] + bottom.shape[0], top.shape[1]), top.stride(), top.storage_offset())


def shared_by_library(x_s: torch.Tensor, w1_s: torch.Tensor, w3_s: torch.Tensor, w2_s: torch.Tensor,
                      out: torch.Tensor, beta: float, lin_beta: float) -> None:
    """out <- round(SiTU(x_s @ w1_s^T, x_s @ w3_s^T) @ w2_s^T) with two GEMMs (gate/up merged) or three."""
    inter_s = w1_s.shape[0]
    merged = merged_rows(w1_s, w3_s)
    if merged is not None:
        h = _linear(x_s, merged)
        g, u = h[:, :inter_s], h[:, inter_s:]
    else:
        g, u = _linear(x_s, w1_s), _linear(x_s, w3_s)
    act = situ_pair(g, u, beta, lin_beta)
    _linear(act, w2_s, out)
