"""The shared expert as library (cuBLAS) GEMMs, for producers whose routed grid runs without it.

Same roundings as the unfused block: BF16 GEMM outputs with FP32 accumulation, SiTU in FP32 rounded
to BF16, the down product written straight into the fragment buffer. A merged [2 I_s, H] gate/up
parameter arrives as two row-block views; when the views are adjacent in one storage they run as one
GEMM, like the unfused block's merged matmul, and the SiTU is one Triton pass over both halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .situ_rows import situ_pair


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
        h = F.linear(x_s, merged)
        g, u = h[:, :inter_s], h[:, inter_s:]
    else:
        g, u = F.linear(x_s, w1_s), F.linear(x_s, w3_s)
    act = situ_pair(g, u, beta, lin_beta)
    torch.mm(act, w2_s.t(), out=out)
