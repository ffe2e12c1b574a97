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
of W2, FP32 pair rows out. Both run the MMA with N = 64 on blocks with at most 64 valid rows; the wgmma is
synchronous (the register operand would double its registers in flight), the two CTAs of an SM overlap each other.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ...common.triton_compat import cta_barrier
from .lut_dequant import WINDOW_SCALE, dequant_mma, words_layout
from .routed_gemm import _program_tile, _valid_rows, store_pair_rows
from .routed_staged import store_situ_rows

_UNWINDOW = gl.constexpr(WINDOW_SCALE)
BK: gl.constexpr = gl.constexpr(128)  # k per step: kappa's span
BUFFERS: gl.constexpr = gl.constexpr(3)  # activation buffers: step i's read while i + 1's and i + 2's copies fly


@gluon.jit
def _kappa_mainloop(w_ptrs, s_ptrs, a_desc, row0, K, BN: gl.constexpr, ROWS: gl.constexpr, NW: gl.constexpr):
    """acc [BN, ROWS] = W_tile @ act^T over K (FP32, the 2^WINDOW offset undone). w_ptrs / s_ptrs: the words and
    scale bytes of k = 0 in words_layout; a_desc: the activation rows in kappa order, [128, BK] boxes from row0
    (a block with at most 64 valid rows runs N = 64 on the first half of each box)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
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
        buf = acts.index(i % BUFFERS)
        if ROWS < 128:
            buf = buf.slice(0, ROWS)
        acc = dequant_mma(wd, sc, buf, acc, ROWS, BN, BK, NW)
        wd = wd_nx
        sc = sc_nx
    for b in gl.static_range(BUFFERS):
        mbarrier.invalidate(ready.index(b))
    return acc * _UNWINDOW


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
def _l1_rows(a_desc, w_ptrs, s_ptrs, act_ptr, row0, n0, inter, K, beta, lin_beta, ROWS: gl.constexpr,
             NW: gl.constexpr):
    BN: gl.constexpr = 16 * NW
    acc = _kappa_mainloop(w_ptrs, s_ptrs, a_desc, row0, K, BN, ROWS, NW)
    store_situ_rows(acc, act_ptr, row0, n0, inter, beta, lin_beta, ROWS, NW, KAPPA=True)


@gluon.jit
def l1_kappa_kernel(w_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K, row_words, row_scales, stride_we,
                    stride_se, beta, lin_beta, a_desc, BM: gl.constexpr, num_warps: gl.constexpr):
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
        args = (a_desc, w_ptrs, s_ptrs, act_ptr, blk * BM, n0, inter, K, beta, lin_beta)
        if _valid_rows(sorted_ptr, blk * BM, BM, NW) <= BM // 2:
            _l1_rows(*args, BM // 2, NW)
        else:
            _l1_rows(*args, BM, NW)


@gluon.jit
def _l2_rows(a_desc, w_ptrs, s_ptrs, sorted_ptr, pairs_ptr, row0, n0, latent, K, ROWS: gl.constexpr,
             NW: gl.constexpr):
    BN: gl.constexpr = 16 * NW
    acc = _kappa_mainloop(w_ptrs, s_ptrs, a_desc, row0, K, BN, ROWS, NW)
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    store_pair_rows(acc, pairs_ptr, sorted_ptr, row0, n0, latent, mma_l, ROWS, BN)


@gluon.jit
def l2_kappa_kernel(w_ptr, s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, latent, K, row_words, row_scales, stride_we,
                    stride_se, a_desc, BM: gl.constexpr, num_warps: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T (FP32) for the valid rows of each block; act in kappa
    order (as L1 wrote it)."""
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert, _ = _program_tile(block_expert_ptr, latent, BN, 1)
    if expert >= 0:
        rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, words_layout(BN, BK, NW)))
        w_ptrs, s_ptrs = _fragment_ptrs(w_ptr, s_ptr, expert, rows, row_words, row_scales, stride_we, stride_se, BN,
                                        NW)
        args = (a_desc, w_ptrs, s_ptrs, sorted_ptr, pairs_ptr, blk * BM, n0, latent, K)
        if _valid_rows(sorted_ptr, blk * BM, BM, NW) <= BM // 2:
            _l2_rows(*args, BM // 2, NW)
        else:
            _l2_rows(*args, BM, NW)
