"""Rows with every 128-wide chunk of their columns in kappa order, for the kappa kernels' activations
(ops/routed/gluon/routed_kappa.py; lut_dequant.py defines kappa): out[r, c * 128 + kappa] = x[src(r), c * 128 + k].

gather_kappa_rows: out row r holds the row of sorted pair r's token (the rows of the expert blocks, so that L1 can
read them by TMA as L2 reads its act rows); padding pairs read token 0 (their sums are never stored) and the rows of
unused blocks (expert -1) are left unwritten (no kernel reads them). One program per (16 rows of one block, 128
columns): each row's 256 bytes loaded in k order, permuted in registers, stored in one piece."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KAPPA_CHUNK = 128
ROWS_PER_PROGRAM = 16


@triton.jit
def gather_kappa_rows_kernel(x_ptr, sorted_ptr, block_expert_ptr, out_ptr, rows, n, top_k, ROWS: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    if tl.load(block_expert_ptr + row0 // BLOCK_ROWS) < 0:  # an unused block: nobody reads its rows
        return
    r = row0 + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * 128
    live = r < rows
    pair = tl.load(sorted_ptr + r, mask=live, other=0)
    src = tl.where(pair >= 0, pair // top_k, 0).to(tl.int64)
    k = tl.arange(0, 128)
    x = tl.load(x_ptr + src[:, None] * n + c0 + k[None, :], mask=live[:, None])
    # k = 32q + 8w + 4e + 2h + c0  ->  kappa = 32w + 16c0 + 8h + 2q + e
    x = tl.permute(tl.reshape(x, [ROWS, 4, 4, 2, 2, 2]), [0, 2, 5, 4, 1, 3])  # (r, q, w, e, h, c0) -> (r, w, c0, h, q, e)
    tl.store(out_ptr + r[:, None].to(tl.int64) * n + c0 + k[None, :], tl.reshape(x, [ROWS, 128]), mask=live[:, None])


def gather_kappa_rows(x: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor, block_rows: int,
                      top_k: int) -> torch.Tensor:
    """[blocks x block_rows, n]: row r is x[sorted_pairs[r] // top_k] (token 0 where the pair is -1) with each
    128-wide column chunk in kappa order; the rows of blocks whose expert is -1 unwritten. x: contiguous [tokens, n],
    n a multiple of 128; block_rows a multiple of 16."""
    rows = block_expert.numel() * block_rows
    n = x.shape[1]
    if x.dim() != 2 or n % KAPPA_CHUNK or not x.is_contiguous():
        raise ValueError(f"kappa rows take contiguous [tokens, n] rows with n a multiple of {KAPPA_CHUNK}: got "
                         f"{tuple(x.shape)}, contiguous={x.is_contiguous()}")
    if sorted_pairs.numel() < rows or block_rows % ROWS_PER_PROGRAM:
        raise ValueError(f"{block_expert.numel()} blocks of {block_rows} rows (a multiple of {ROWS_PER_PROGRAM}) "
                         f"asked for, {sorted_pairs.numel()} sorted pairs given")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), n // KAPPA_CHUNK)
    gather_kappa_rows_kernel[grid](x, sorted_pairs, block_expert, out, rows, n, top_k, ROWS=ROWS_PER_PROGRAM,
                                   BLOCK_ROWS=block_rows)
    return out
