"""Routed MXFP4 expert GEMMs for prefill blocks (128 rows, sm_90): the dequantised weights as the wgmma's register
operand, the activations in kappa order straight from global memory to shared memory.

The staged kernels (routed_staged.py) dequantise every weight tile into shared memory and read it back as the
wgmma's A operand: per 64-wide k step of a 128 x 128 tile, 88 KB of shared-memory traffic (the tile stored and read
by both warp groups, the activations copied in and read by both, the weight words) against 512 cycles of MMA at the
nominal rate, so shared memory, not the tensor cores, sets their pace (Nsight Compute: 81 % busy). Here the weights
never touch shared memory: every thread loads the 16 bytes of its own A fragment (lut_dequant.py's kappa order: the
MMA's k order permuted so that thread q of a row owns k 32q .. 32q + 31 of the standard layout) one step ahead and
expands them in registers. The register-dequant kernels (routed_gemm.py) do the same but permute the activation
tile into kappa order through registers, every step; here the activations already are in kappa order in global
memory, so one TMA copy a step moves a [128, 128] tile to shared memory untouched (3 buffers, two steps ahead):

- L1 reads the rows of its blocks from a copy of z gathered and permuted (triton/kappa_columns.gather_kappa_rows,
  one pass per call: each block row its token's row, every 128-wide chunk of the columns in kappa order);
- L1 writes act with the same column order, so L2 reads it as it is (act is the op's own buffer).

Per 128-wide k step: 32 KB of activations copied in and 64 KB read by the two warp groups, about half the staged
kernels' traffic per MMA (docs/design/prefill.md, "The kappa kernels"). The sums take k in the register kernels'
kappa order in 16-wide MMA chunks: the staged kernels' values to FP32 rounding (rel. L2 ~1e-4), not their bits.

L1: 128 weight rows, the gate rows n0 .. n0 + 64 then the same columns' up rows, SiTU in the epilogue. L2: 128 rows
of W2, FP32 pair rows out. Both run the MMA's N by the block's valid rows (TIERS: 16, 32, 64, 64 + 16, 64 + 32 or
128; else 64 or 128): a block's rows past its valid ones are never multiplied, and a column's sums do not depend on
N. The wgmma is synchronous (asynchronous halves measured slower: docs/design/prefill.md), the two CTAs of an SM
overlap each other.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

from ...common.triton_compat import cta_barrier
from .lut_dequant import WINDOW_SCALE, dequant_operand, words_layout
from .routed_gemm import _program_tile, _valid_rows, store_pair_rows
from .routed_staged import store_situ_rows

_UNWINDOW = gl.constexpr(WINDOW_SCALE)
BK: gl.constexpr = gl.constexpr(128)  # k per step: kappa's span
BUFFERS: gl.constexpr = gl.constexpr(3)  # activation buffers: step i's read while i + 1's and i + 2's copies fly


@gluon.constexpr_function
def _extra_cols(EXTRA):
    """The second accumulator's columns: EXTRA, or a placeholder the compiler drops when there is none."""
    return max(EXTRA, 16)


@gluon.jit
def _mma_rows(a, buf, acc, acc2, ROWS: gl.constexpr, EXTRA: gl.constexpr, NW: gl.constexpr):
    """acc += a @ buf[:ROWS]^T and, for EXTRA rows more, acc2 += a @ buf[ROWS:ROWS + EXTRA]^T on the same register
    fragment (tensor shapes are powers of two, so 80 and 96 rows run as 64 + 16 and 64 + 32)."""
    rows = buf
    if ROWS < 128:
        rows = buf.slice(0, ROWS)
    acc = warpgroup_mma(a, rows.permute((1, 0)), acc)
    if EXTRA > 0:
        mma_x: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, EXTRA, 16])
        a_x: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_x, k_width=2)
        acc2 = warpgroup_mma(gl.convert_layout(a, a_x, assert_trivial=True), buf.slice(ROWS, EXTRA).permute((1, 0)),
                             acc2)
    return acc, acc2


@gluon.jit
def _kappa_mainloop(w_ptrs, s_ptrs, a_desc, row0, K, BN: gl.constexpr, ROWS: gl.constexpr, EXTRA: gl.constexpr,
                    NW: gl.constexpr):
    """acc [BN, ROWS] (and acc2 [BN, EXTRA] for the rows after them) = W_tile @ act^T over K (FP32, the 2^WINDOW
    offset undone). w_ptrs / s_ptrs: the words and scale bytes of k = 0 in words_layout; a_desc: the activation
    rows in kappa order, [128, BK] boxes from row0 (a block with fewer valid rows multiplies only its first ones)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    XN: gl.constexpr = _extra_cols(EXTRA)
    mma_x: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, XN, 16])
    acts = gl.allocate_shared_memory(a_desc.dtype, [BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], bar_l)
    n_steps = K // BK
    for b in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(b), count=1)
    for b in gl.static_range(BUFFERS - 1):
        mbarrier.expect(ready.index(b), a_desc.block_type.nbytes, pred=b < n_steps)
        tma.async_copy_global_to_shared(a_desc, [row0, b * BK], ready.index(b), acts.index(b), pred=b < n_steps)
    wd = gl.load(w_ptrs)
    sc = gl.load(s_ptrs)
    acc = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    acc2 = gl.zeros([BN, XN], gl.float32, layout=mma_x)
    for i in range(n_steps):
        k_nx = gl.minimum(i + 1, n_steps - 1) * BK  # the last step reloads its own
        wd_nx = gl.load(w_ptrs + k_nx // 8)
        sc_nx = gl.load(s_ptrs + k_nx // 32)
        # every warp finished its (synchronous) wgmma of step i - 1, the last reader of the buffer refilled here
        cta_barrier()
        nx = i + BUFFERS - 1
        mbarrier.expect(ready.index(nx % BUFFERS), a_desc.block_type.nbytes, pred=nx < n_steps)
        tma.async_copy_global_to_shared(a_desc, [row0, nx * BK], ready.index(nx % BUFFERS), acts.index(nx % BUFFERS),
                                        pred=nx < n_steps)
        mbarrier.wait(ready.index(i % BUFFERS), (i // BUFFERS) & 1)
        a = dequant_operand(wd, sc, ROWS, BN, BK, NW)
        acc, acc2 = _mma_rows(a, acts.index(i % BUFFERS), acc, acc2, ROWS, EXTRA, NW)
        wd = wd_nx
        sc = sc_nx
    for b in gl.static_range(BUFFERS):
        mbarrier.invalidate(ready.index(b))
    return acc * _UNWINDOW, acc2 * _UNWINDOW


@gluon.jit
def _fragment_ptrs(w_ptr, s_ptr, expert, rows, row_words, row_scales, stride_we, stride_se, BN: gl.constexpr,
                   NW: gl.constexpr):
    """Words [BN, 16] (one 16-byte fragment per thread and row) and scale-byte pointers of k = 0 for weight rows
    `rows` (a [BN] tensor in words_layout's row slice)."""
    words_l: gl.constexpr = words_layout(BN, BK, NW)
    rj = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, words_l))
    e = expert.to(gl.int64)
    r = rows[:, None].to(gl.int64)
    return (w_ptr + e * stride_we + r * row_words + rj[None, :],
            s_ptr + e * stride_se + r * row_scales + (rj // 4)[None, :])


@gluon.jit
def _kappa_tile(a_desc, w_ptrs, s_ptrs, sorted_ptr, out_ptr, row0, n0, n_out, K, beta, lin_beta, GATED: gl.constexpr,
                ROWS: gl.constexpr, EXTRA: gl.constexpr, NW: gl.constexpr):
    """One tile's main loop and epilogue on rows row0 .. row0 + ROWS + EXTRA: L1 (GATED) writes act (n_out = I
    columns, each at its kappa position), L2 the FP32 pair rows (n_out = L)."""
    BN: gl.constexpr = 16 * NW
    acc, acc2 = _kappa_mainloop(w_ptrs, s_ptrs, a_desc, row0, K, BN, ROWS, EXTRA, NW)
    if GATED:
        store_situ_rows(acc, out_ptr, row0, n0, n_out, beta, lin_beta, ROWS, NW, KAPPA=True)
        if EXTRA > 0:
            store_situ_rows(acc2, out_ptr, row0 + ROWS, n0, n_out, beta, lin_beta, EXTRA, NW, KAPPA=True)
    else:
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, ROWS, 16])
        store_pair_rows(acc, out_ptr, sorted_ptr, row0, n0, n_out, mma_l, ROWS, BN)
        if EXTRA > 0:
            mma_x: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                            instr_shape=[16, EXTRA, 16])
            store_pair_rows(acc2, out_ptr, sorted_ptr, row0 + ROWS, n0, n_out, mma_x, EXTRA, BN)


@gluon.jit
def _by_valid_rows(a_desc, w_ptrs, s_ptrs, sorted_ptr, out_ptr, row0, n0, n_out, K, beta, lin_beta,
                   GATED: gl.constexpr, BM: gl.constexpr, NW: gl.constexpr, TIERS: gl.constexpr):
    """The MMA's N from the block's valid rows (they come first): with TIERS 16, 32, 64, 64 + 16, 64 + 32 or 128
    (an expert's ~73 rows at M = 4096 take 80 columns, not 128; the 18-row tails at 8192 take 32, not 64); without,
    64 or 128."""
    args = (a_desc, w_ptrs, s_ptrs, sorted_ptr, out_ptr, row0, n0, n_out, K, beta, lin_beta)  # constexprs apart
    valid = _valid_rows(sorted_ptr, row0, BM, NW)
    if TIERS:
        if valid <= 16:
            _kappa_tile(*args, GATED, 16, 0, NW)
        elif valid <= 32:
            _kappa_tile(*args, GATED, 32, 0, NW)
        elif valid <= 64:
            _kappa_tile(*args, GATED, 64, 0, NW)
        elif valid <= 80:
            _kappa_tile(*args, GATED, 64, 16, NW)
        elif valid <= 96:
            _kappa_tile(*args, GATED, 64, 32, NW)
        else:
            _kappa_tile(*args, GATED, BM, 0, NW)
    else:
        if valid <= BM // 2:
            _kappa_tile(*args, GATED, BM // 2, 0, NW)
        else:
            _kappa_tile(*args, GATED, BM, 0, NW)


@gluon.jit
def l1_kappa_kernel(w_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K, row_words, row_scales, stride_we,
                    stride_se, beta, lin_beta, a_desc, BM: gl.constexpr, num_warps: gl.constexpr,
                    TIERS: gl.constexpr):
    """act[block rows, kappa(n0 .. n0 + BN/2)] = bf16(SiTU(gate, up)) from the block rows of z in kappa order
    (triton/kappa_columns.gather_kappa_rows); one program per (block, BN/2 columns)."""
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    HALF: gl.constexpr = BN // 2
    blk, n0, expert, _ = _program_tile(block_expert_ptr, inter, HALF, 1)
    if expert >= 0:
        rn = gl.arange(0, BN, layout=gl.SliceLayout(1, words_layout(BN, BK, NW)))
        rows = gl.where(rn < HALF, n0 + rn, inter + n0 + rn - HALF)
        w_ptrs, s_ptrs = _fragment_ptrs(w_ptr, s_ptr, expert, rows, row_words, row_scales, stride_we, stride_se, BN,
                                        NW)
        _by_valid_rows(a_desc, w_ptrs, s_ptrs, sorted_ptr, act_ptr, blk * BM, n0, inter, K, beta, lin_beta, True, BM,
                       NW, TIERS)


@gluon.jit
def l2_kappa_kernel(w_ptr, s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, latent, K, row_words, row_scales, stride_we,
                    stride_se, a_desc, BM: gl.constexpr, num_warps: gl.constexpr, TIERS: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T (FP32) for the valid rows of each block; act in kappa
    order (as L1 wrote it)."""
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert, _ = _program_tile(block_expert_ptr, latent, BN, 1)
    if expert >= 0:
        rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, words_layout(BN, BK, NW)))
        w_ptrs, s_ptrs = _fragment_ptrs(w_ptr, s_ptr, expert, rows, row_words, row_scales, stride_we, stride_se, BN,
                                        NW)
        _by_valid_rows(a_desc, w_ptrs, s_ptrs, sorted_ptr, pairs_ptr, blk * BM, n0, latent, K, 0.0, 0.0, False, BM,
                       NW, TIERS)
