"""Rows with every 128-wide chunk of their columns in kappa order, for the kappa kernels' activations
(ops/routed/gluon/routed_kappa.py; lut_dequant.py defines kappa): out[r, c * 128 + kappa] = x[src(r), c * 128 + k].

gather_kappa_rows: out row r holds the row of sorted pair r's token (the rows of the expert blocks, so that L1 can
read them by TMA as L2 reads its act rows); padding pairs read token 0 (L1 writes act rows for them that L2 computes
with, but the combine never reads their pair rows) and the rows of unused blocks (expert -1) are left unwritten (no
kernel reads them). kappa_positions and to_kappa_columns are the permutation's definitions on the host. A few
persistent programs per SM stride over the rows in groups of 32 (one block's), every column of a group, each row's
256 bytes of a chunk loaded in k order, permuted in registers, stored in one piece."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...common.device_capability import sm_count

KAPPA_CHUNK = 128  # kappa permutes k within 128-wide chunks (lut_dequant.py: one 128-wide register-kernel step)
ROWS_PER_GROUP = 32
CHUNKS_PER_STEP = 1
WARPS = 4
# Programs per SM of the persistent gather. One program per (16 rows, 128 columns) of every allocated block (the
# host's bound, ~4x the used rows) took 89 / 317 / 645 us at M = 4096 / 16384 / 32768 on the H200 (latency-bound:
# most programs only read their block's expert and exit); 8 persistent programs per SM over 32-row groups, 43 / 136 /
# 250 us, at the copy rate (docs/design/prefill.md).
PROGRAMS_PER_SM = 8
INTERPRETER_PROGRAMS = 4  # on the CPU: enough to run the grid-stride loop more than once


def _programs(device: torch.device) -> int:
    return PROGRAMS_PER_SM * sm_count(device) if device.type == "cuda" else INTERPRETER_PROGRAMS


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
                             BLOCK_ROWS: tl.constexpr, CHUNKS: tl.constexpr):
    """Persistent: each program strides over the groups of ROWS rows (an unused block's group costs one load) and
    moves every column of a group, CHUNKS 128-wide chunks a step: each row's bytes loaded in k order, permuted in
    registers, stored in one piece."""
    k = tl.arange(0, 128 * CHUNKS)
    for g in range(tl.program_id(0), rows // ROWS, tl.num_programs(0)):
        row0 = g * ROWS
        if tl.load(block_expert_ptr + row0 // BLOCK_ROWS) >= 0:
            r = row0 + tl.arange(0, ROWS)
            pair = tl.load(sorted_ptr + r)
            src = tl.where(pair >= 0, pair // top_k, 0).to(tl.int64)
            src_row = x_ptr + src[:, None] * n
            dst_row = out_ptr + r[:, None].to(tl.int64) * n
            for c0 in range(0, n, 128 * CHUNKS):
                x = tl.load(src_row + c0 + k[None, :])
                x = tl.permute(tl.reshape(x, [ROWS, CHUNKS, 4, 4, 2, 2, 2]), [0, 1, 3, 6, 5, 2, 4])
                tl.store(dst_row + c0 + k[None, :], tl.reshape(x, [ROWS, 128 * CHUNKS]))


def gather_kappa_rows(x: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor, block_rows: int,
                      top_k: int) -> torch.Tensor:
    """[blocks x block_rows, n]: row r is x[sorted_pairs[r] // top_k] (token 0 where the pair is -1) with each
    128-wide column chunk in kappa order; the rows of blocks whose expert is -1 unwritten. x: contiguous [tokens, n],
    n a multiple of 128; block_rows a multiple of 32."""
    rows = block_expert.numel() * block_rows
    if x.dim() != 2 or x.shape[1] % KAPPA_CHUNK:
        raise ValueError(f"gather_kappa_rows: x must be [tokens, n] with n a multiple of {KAPPA_CHUNK}, got shape "
                         f"{tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"gather_kappa_rows: x must be contiguous (pass x.contiguous()), got strides {x.stride()}")
    if block_rows % ROWS_PER_GROUP:
        raise ValueError(f"gather_kappa_rows: block_rows must be a multiple of {ROWS_PER_GROUP}, got {block_rows}")
    if sorted_pairs.numel() < rows:
        raise ValueError(f"gather_kappa_rows: {block_expert.numel()} blocks of {block_rows} rows need {rows} sorted "
                         f"pairs, got {sorted_pairs.numel()}")
    n = x.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (max(1, min(rows // ROWS_PER_GROUP, _programs(x.device))),)
    gather_kappa_rows_kernel[grid](x, sorted_pairs, block_expert, out, rows, n, top_k, ROWS=ROWS_PER_GROUP,
                                   BLOCK_ROWS=block_rows, CHUNKS=CHUNKS_PER_STEP, num_warps=WARPS)
    return out
