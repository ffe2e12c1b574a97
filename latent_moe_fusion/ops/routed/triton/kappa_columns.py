"""Rows with every 128-wide chunk of their columns in kappa order, for the kappa kernels' activations
(ops/routed/gluon/routed_kappa.py; lut_dequant.py defines kappa): out[r, c * 128 + kappa] = x[src(r), c * 128 + k].

gather_kappa_rows: out row r holds the row of sorted pair r's token (the rows of the expert blocks, so that L1 can
read them by TMA as L2 reads its act rows); padding pairs read token 0 (L1 writes act rows for them that L2 computes
with, but the combine never reads their pair rows) and the rows of unused blocks (expert -1) are left unwritten (no
kernel reads them). kappa_positions and to_kappa_columns are the permutation's definitions on the host. One program per (16 rows of one block, 128
columns): each row's 256 bytes loaded in k order, permuted in registers, stored in one piece."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KAPPA_CHUNK = 128  # kappa permutes k within 128-wide chunks (lut_dequant.py: one 128-wide register-kernel step)
ROWS_PER_PROGRAM = 16


def kappa_positions(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """pos[k]: where column k of a row goes in kappa order (within its 128-wide chunk; n a multiple of 128)."""
    k = torch.arange(n, device=device)
    r = k % KAPPA_CHUNK
    q, w, e, h, c0 = r // 32, (r // 8) % 4, (r // 4) % 2, (r // 2) % 2, r % 2
    return k - r + 32 * w + 16 * c0 + 8 * h + 2 * q + e


def to_kappa_columns(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] with every 128-wide chunk of its columns in kappa order (lut_dequant.to_kappa), contiguous: the
    definition the gather kernel and the kappa L1's act stores are tested against."""
    rows, n = x.shape
    # (row, chunk, q, w, e, h, c0) -> (row, chunk, w, c0, h, q, e)
    return x.reshape(rows, n // KAPPA_CHUNK, 4, 4, 2, 2, 2).permute(0, 1, 3, 6, 5, 2, 4).reshape(rows, n)


@triton.jit
def gather_kappa_rows_kernel(x_ptr, sorted_ptr, block_expert_ptr, out_ptr, rows, n, top_k, ROWS: tl.constexpr,
                             BLOCK_ROWS: tl.constexpr):
    row0 = tl.program_id(0) * ROWS
    if tl.load(block_expert_ptr + row0 // BLOCK_ROWS) < 0:  # an unused block: nobody reads its rows
        return
    r = row0 + tl.arange(0, ROWS)
    c0 = tl.program_id(1) * 128
    live = r < rows  # always true where block_rows is a multiple of ROWS (the wrapper checks); kept for safety
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
    if x.dim() != 2 or x.shape[1] % KAPPA_CHUNK:
        raise ValueError(f"gather_kappa_rows: x must be [tokens, n] with n a multiple of {KAPPA_CHUNK}, got shape "
                         f"{tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"gather_kappa_rows: x must be contiguous (pass x.contiguous()), got strides {x.stride()}")
    if block_rows % ROWS_PER_PROGRAM:
        raise ValueError(f"gather_kappa_rows: block_rows must be a multiple of {ROWS_PER_PROGRAM}, got {block_rows}")
    if sorted_pairs.numel() < rows:
        raise ValueError(f"gather_kappa_rows: {block_expert.numel()} blocks of {block_rows} rows need {rows} sorted "
                         f"pairs, got {sorted_pairs.numel()}")
    n = x.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), n // KAPPA_CHUNK)
    gather_kappa_rows_kernel[grid](x, sorted_pairs, block_expert, out, rows, n, top_k, ROWS=ROWS_PER_PROGRAM,
                                   BLOCK_ROWS=block_rows)
    return out
