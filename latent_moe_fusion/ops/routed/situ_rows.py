"""SiTU between GEMMs in one pass, BF16 out: h [rows, 2I] (gate | up) -> act [rows, I] (situ_rows),
or gate and up given as two [rows, I] operands (situ_pair).

situ_rows serves the DeepGEMM routed backend, whose GEMMs write BF16 h into group-padded buffers: rows
that belong to no token (past a masked group's count, or -1 in a contiguous layout) are skipped, not
computed, so the cost follows the tokens rather than the padding. situ_pair serves the shared expert
run as library GEMMs (shared_by_library), in place of the half-dozen elementwise kernels of torch's SiTU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common.reference_math import situ as situ_math
from ..common.triton_numerics import round_to, situ
from .producer_config import interpreting


@triton.jit
def _situ_rows_kernel(g_ptr, u_ptr, row_stride, out_ptr, counts_ptr, layout_ptr, inter, rows_per_group, beta,
                      lin_beta, MODE: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0)
    if MODE == 1:  # masked: row r is token r % rows_per_group of group r // rows_per_group
        if row % rows_per_group >= tl.load(counts_ptr + row // rows_per_group):
            return
    if MODE == 2:  # contiguous: padding rows carry group -1
        if tl.load(layout_ptr + row) < 0:
            return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    offset = row.to(tl.int64) * row_stride
    g = tl.load(g_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offset + cols, mask=mask, other=0.0).to(tl.float32)
    act = situ(g, u, beta, lin_beta)
    tl.store(out_ptr + row.to(tl.int64) * inter + cols, round_to(act, tl.bfloat16, INTERPRET), mask=mask)


def situ_rows(h: torch.Tensor, beta: float, lin_beta: float, *, masked_counts: torch.Tensor | None = None,
              grouped_layout: torch.Tensor | None = None) -> torch.Tensor:
    """SiTU of a BF16 [..., rows, 2I] buffer into a new [..., rows, I] one. With masked_counts (int32
    [G], h [G, rows, 2I]) or grouped_layout (int32 [rows]), rows that hold no token are left unwritten."""
    if h.dtype != torch.bfloat16 or not h.is_contiguous() or h.shape[-1] % 2:
        raise ValueError(f"situ_rows needs a contiguous bfloat16 [..., 2I] buffer, got {h.dtype} {tuple(h.shape)}")
    inter = h.shape[-1] // 2
    out = torch.empty((*h.shape[:-1], inter), dtype=h.dtype, device=h.device)
    rows = h.numel() // (2 * inter)
    if rows == 0:
        return out
    interpret = interpreting()
    if not h.is_cuda and not interpret:
        # CPU tensors outside the interpreter (e.g. a fake deep_gemm in a GPU session): every row, in torch.
        out.copy_(situ_math(h[..., :inter], h[..., inter:], beta, lin_beta))
        return out
    mode, rows_per_group = 0, 1
    if masked_counts is not None:
        mode, rows_per_group = 1, h.shape[-2]
    elif grouped_layout is not None:
        mode = 2
    dummy = torch.empty(1, dtype=torch.int32, device=h.device)
    block = min(1024, triton.next_power_of_2(inter))
    _situ_rows_kernel[(rows, triton.cdiv(inter, block))](
        h, h[..., inter:], 2 * inter, out, masked_counts if masked_counts is not None else dummy,
        grouped_layout if grouped_layout is not None else dummy,
        inter, rows_per_group, float(beta), float(lin_beta),
        MODE=mode, BLOCK=block, INTERPRET=interpret,
    )
    return out


def situ_pair(g: torch.Tensor, u: torch.Tensor, beta: float, lin_beta: float) -> torch.Tensor:
    """SiTU(g, u) of two BF16 [rows, I] operands with unit column stride and one row stride (two
    GEMM outputs, or the two halves of one [rows, 2I] output) into a new contiguous [rows, I]."""
    if (g.dtype != torch.bfloat16 or u.dtype != torch.bfloat16 or g.dim() != 2 or g.shape != u.shape
            or g.stride() != u.stride() or g.stride(1) != 1 or g.device != u.device):
        raise ValueError(
            "situ_pair needs two bfloat16 [rows, I] operands of one shape and one stride (column stride 1), got "
            f"{g.dtype} {tuple(g.shape)} stride {g.stride()} and {u.dtype} {tuple(u.shape)} stride {u.stride()}")
    rows, inter = g.shape
    out = torch.empty(rows, inter, dtype=g.dtype, device=g.device)
    if rows == 0 or inter == 0:
        return out
    interpret = interpreting()
    if not g.is_cuda and not interpret:
        out.copy_(situ_math(g, u, beta, lin_beta))
        return out
    dummy = torch.empty(1, dtype=torch.int32, device=g.device)
    block = min(1024, triton.next_power_of_2(inter))
    _situ_rows_kernel[(rows, triton.cdiv(inter, block))](
        g, u, g.stride(0), out, dummy, dummy, inter, 1, float(beta), float(lin_beta),
        MODE=0, BLOCK=block, INTERPRET=interpret,
    )
    return out
