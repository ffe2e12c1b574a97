"""Routed MXFP4 expert GEMMs with the dequantised weights fed to wgmma from registers (decode, and beyond it while
the experts hold few enough rows: producer_config.prefill_regs_block_m).

Same schedule and outputs as triton/expert_gemm.py for blocks of BM = 16, 32 or 64 (token, slot)
rows (a block's MMA takes N = 16 or 32 where no more of its rows hold a pair): out^T [BN, BM] =
W[e, rows, :] @ act^T, the weight the left operand. The Triton kernels stage every dequantised tile
through shared memory before the MMA (load -> dequant -> store -> barrier -> wgmma, latency-bound:
docs/design/producer.md). Here each thread loads the 16
contiguous bytes of its own fragment (lut_dequant.py: the MMA's k order is permuted so that this holds
for the standard layout), expands them in registers and issues the wgmma with A from registers;
only the small activation tile [BM, 128] goes through shared memory (double-buffered, stored in the
permuted order). The weight words come either by 16-byte loads one step ahead (the "loads" loop
here) or through a ring of shared-memory stages (ring_loops.py: TMA or cp.async).

L1 (gate and up, two accumulators, SiTU of the FP32 sums, act rounded once) and L2 (down, FP32 pair
rows for the combine) as in the Triton kernels; shared-expert tiles are not handled here.

SPLIT > 1 cuts K into SPLIT slices for a single decode token, whose ~2 local experts
give too few programs to keep enough loads in flight: L1 then writes FP32 gate and up slice sums
(routed/split_k_finish.py adds them in slice order and applies SiTU), L2 writes FP32 slice rows
that the combine adds in slice order. Both are bitwise the same on every run.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from ...common.gdc import prefetch_rows_l2, release_dependents, wait_for_predecessor
from ...common.triton_compat import cta_barrier
from ...common.triton_numerics import situ
from .lut_dequant import WINDOW_SCALE, dequant_mma, to_kappa, words_layout
from .ring_loops import load_scales_act, mainloop_cp, mainloop_tma

# dequant_kappa gives the weights times 2^-WINDOW (lut_dequant.py): the FP32 sums are scaled back, exactly.
_UNWINDOW = gl.constexpr(WINDOW_SCALE)

# Launch settings (k step, warps per kernel, block rows) live in __init__.py.


@gluon.jit
def _weight_ptrs(w_ptr, s_ptr, expert, row0, row_words, row_scales, stride_we, stride_se,
                 BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """Pointers to the int32 words [BN, BK/8] (one 16-byte load per thread and row) and their scale
    bytes for k = 0."""
    words_l: gl.constexpr = words_layout(BN, BK, NW)
    rn = row0 + gl.arange(0, BN, layout=gl.SliceLayout(1, words_l))
    rj = gl.arange(0, BK // 8, layout=gl.SliceLayout(0, words_l))
    e = expert.to(gl.int64)
    w_ptrs = w_ptr + e * stride_we + rn[:, None] * row_words + rj[None, :]
    s_ptrs = s_ptr + e * stride_se + rn[:, None] * row_scales + (rj // 4)[None, :]
    return w_ptrs, s_ptrs


@gluon.jit
def _step(wd, sc, wd2, sc2, act, buf, acc, acc2, DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
          BK: gl.constexpr, NW: gl.constexpr):
    buf.store(to_kappa(act, BM, BK))
    fence_async_shared()
    # One barrier per step: a buffer is rewritten two steps later, after every warp passed the next
    # step's barrier and so finished this step's (synchronous) wgmma.
    cta_barrier()
    acc = dequant_mma(wd, sc, buf, acc, BM, BN, BK, NW)
    if DUAL:
        acc2 = dequant_mma(wd2, sc2, buf, acc2, BM, BN, BK, NW)
    return acc, acc2


@gluon.jit
def _load_step(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k, DUAL: gl.constexpr):
    """One k step's operands: weight words and scales (and the second tile's if DUAL), activation tile."""
    wd = gl.load(w_ptrs + k // 8)
    wd2 = wd
    if DUAL:
        wd2 = gl.load(w2_ptrs + k // 8)
    sc, sc2, act = load_scales_act(s_ptrs, s2_ptrs, a_ptrs, a_mask, k, DUAL)
    return wd, sc, wd2, sc2, act


@gluon.jit
def _mainloop(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr):
    """acc (and acc2 if DUAL) [BN, BM] in FP32 over k_begin .. k_end; the next step's loads are issued first."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BM, 16])
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BM, BK], b_sl)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    acc2 = gl.zeros([BN, BM], gl.float32, layout=mma_l)
    wd, sc, wd2, sc2, act = _load_step(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, DUAL)
    i = 0
    for k0 in range(k_begin, k_end, BK):
        k_nx = gl.multiple_of(gl.minimum(k0 + BK, k_end - BK), BK)  # the last step reloads itself
        wd_nx, sc_nx, wd2_nx, sc2_nx, act_nx = _load_step(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_nx, DUAL)
        acc, acc2 = _step(wd, sc, wd2, sc2, act, b_smem.index(i % 2), acc, acc2, DUAL, BM, BN, BK, NW)
        wd, sc, wd2, sc2, act = wd_nx, sc_nx, wd2_nx, sc2_nx, act_nx
        i += 1
    return acc, acc2


@gluon.jit
def _weight_mainloop(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, w_desc, w_row, a_ptrs, a_mask, k_begin, k_end,
                     DUAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr,
                     RING: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr):
    """The K loop with the weight words by the loads or through a ring (ring_loops.py); the FP32 sums
    times 2^WINDOW, undoing the dequantiser's offset (exact)."""
    if RING == "tma":
        acc, acc2 = mainloop_tma(w_desc, w_row, s_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL, BM, BN, BK, NW,
                                 ORDER)
    elif RING == "cp":
        acc, acc2 = mainloop_cp(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL, BM, BN, BK, NW,
                                STAGES)
    else:
        acc, acc2 = _mainloop(w_ptrs, s_ptrs, w2_ptrs, s2_ptrs, a_ptrs, a_mask, k_begin, k_end, DUAL, BM, BN, BK, NW)
    return acc * _UNWINDOW, acc2 * _UNWINDOW


@gluon.jit
def _k_slice(K, k_index, SPLIT: gl.constexpr, BK: gl.constexpr):
    """This program's K range: all of K, or slice k_index of SPLIT (K a multiple of SPLIT * BK)."""
    if SPLIT == 1:
        k_begin = 0
        k_end = K
    else:
        k_len = K // SPLIT
        k_begin = gl.multiple_of(k_index * k_len, BK)
        k_end = k_begin + k_len
    return k_begin, k_end


@gluon.jit
def _l1_rows(z_ptr, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, w_desc, w_row, sorted_ptr, act_ptr, h_part_ptr, n_rows,
             k_index, row0, n0, inter, K, top_k, beta, lin_beta, ROWS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
             NW: gl.constexpr, SPLIT: gl.constexpr, RING: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr):
    """act[row0 .. row0 + ROWS, n0 .. n0 + BN] = bf16(SiTU(gate, up)) of the rows' tokens; with SPLIT > 1
    this K slice's FP32 gate and up sums into h_part[slice, rows, n (gate) | inter + n (up)] instead."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    act_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    pos = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    pair = gl.load(sorted_ptr + pos)
    tok = gl.where(pair >= 0, pair // top_k, 0)
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, act_l))
    a_ptrs = z_ptr + tok[:, None].to(gl.int64) * K + ak[None, :]
    a_mask = (pair >= 0)[:, None] & (ak >= 0)[None, :]
    k_begin, k_end = _k_slice(K, k_index, SPLIT, BK)
    g, u = _weight_mainloop(wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, w_desc, w_row, a_ptrs, a_mask, k_begin, k_end, True,
                            ROWS, BN, BK, NW, RING, STAGES, ORDER)
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l))
    if SPLIT == 1:
        # numerics.situ itself (a @triton.jit function inlined by Gluon: the same SASS as a hand copy)
        h = situ(g, u, beta, lin_beta)
        gl.store(act_ptr + om[None, :].to(gl.int64) * inter + on[:, None], h.to(act_ptr.dtype.element_ty))
    else:
        part_row = k_index * n_rows + om
        dest = h_part_ptr + part_row[None, :].to(gl.int64) * (2 * inter) + on[:, None]
        gl.store(dest, g)
        gl.store(dest + inter, u)


@gluon.jit
def _l2_rows(act_ptr, w_ptrs, s_ptrs, w_desc, w_row, sorted_ptr, pairs_ptr, slice_stride, k_index, row0, n0, latent,
             K, ROWS: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, NW: gl.constexpr, SPLIT: gl.constexpr,
             RING: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + BN] = act[row] @ W2^T for the valid rows of row0 .. row0 + ROWS
    (with SPLIT > 1: this K slice's sum, at pairs + slice * slice_stride)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, ROWS, 16])
    act_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NW, 1], [1, 0])
    am = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, act_l))
    ak = gl.arange(0, BK, layout=gl.SliceLayout(0, act_l))
    a_ptrs = act_ptr + am[:, None].to(gl.int64) * K + ak[None, :]
    a_mask = (am >= 0)[:, None] & (ak >= 0)[None, :]
    k_begin, k_end = _k_slice(K, k_index, SPLIT, BK)
    acc, _ = _weight_mainloop(w_ptrs, s_ptrs, w_ptrs, s_ptrs, w_desc, w_row, a_ptrs, a_mask, k_begin, k_end, False,
                              ROWS, BN, BK, NW, RING, STAGES, ORDER)
    if SPLIT > 1:
        pairs_ptr += k_index.to(gl.int64) * slice_stride
    store_pair_rows(acc, pairs_ptr, sorted_ptr, row0, n0, latent, mma_l, ROWS, BN)


@gluon.jit
def store_pair_rows(acc, pairs_ptr, sorted_ptr, row0, n0, latent, mma_l: gl.constexpr, ROWS: gl.constexpr,
                    BN: gl.constexpr):
    """L2's epilogue: acc [BN, ROWS] (columns n0 .. n0 + BN of rows row0 .. row0 + ROWS) into the FP32 pair rows
    of the block's valid rows."""
    on = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
    om = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_l))
    pair = gl.load(sorted_ptr + om)
    dest = pairs_ptr + pair[None, :].to(gl.int64) * latent + on[:, None]
    gl.store(dest, acc, mask=(pair >= 0)[None, :] & (on >= 0)[:, None])


@gluon.jit
def _valid_rows(sorted_ptr, row0, BM: gl.constexpr, NW: gl.constexpr):
    """How many rows of the block at row0 hold a pair (they come first). A block with at most half of BM (or a
    quarter) valid runs the MMA with that N on its first rows: decode batches estimate rows per expert from all
    (token, slot) pairs, most of which, under expert parallelism, belong to other ranks, and an expert's last
    prefill block is partly empty."""
    rows_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    valid = gl.load(sorted_ptr + row0 + gl.arange(0, BM, layout=rows_l)) >= 0
    return gl.sum(valid.to(gl.int32), axis=0)


@gluon.jit
def _program_tile(block_expert_ptr, n_total, BN: gl.constexpr, SPLIT: gl.constexpr):
    """This program's expert block, its first weight row, the block's expert (-1: unused block) and its
    K slice. The block is the slowest index: the programs of the used blocks (which come first) start
    before the unused blocks' programs, which only read the expert and exit."""
    tiles_n = n_total // BN
    pid = gl.program_id(0)
    blk = pid // (tiles_n * SPLIT)
    within = pid % (tiles_n * SPLIT)
    return blk, (within % tiles_n) * BN, gl.load(block_expert_ptr + blk), within // tiles_n


@gluon.jit(do_not_specialize=["top_k"])
def l1_regs_kernel(
    z_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, h_part_ptr, n_rows, inter, K, row_words, row_scales,
    top_k, stride_we, stride_se, beta, lin_beta, w_desc,
    BM: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr, SIGNAL: gl.constexpr = False,
    RING: gl.constexpr = "loads", STAGES: gl.constexpr = 0, ORDER: gl.constexpr = "auto",
):
    if SIGNAL:  # the dependent finish / L2 may launch now (they wait for this kernel's end)
        release_dependents()
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    blk, n0, expert, k_index = _program_tile(block_expert_ptr, inter, BN, SPLIT)
    if expert >= 0:
        wg_ptrs, sg_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, n0, row_words, row_scales, stride_we, stride_se,
                                        BN, BK, NW)
        wu_ptrs, su_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, inter + n0, row_words, row_scales, stride_we,
                                        stride_se, BN, BK, NW)
        w_row = (2 * expert, n0)  # the gate and up tiles' box in the [2E, I, K / 8] words
        args = (z_ptr, wg_ptrs, sg_ptrs, wu_ptrs, su_ptrs, w_desc, w_row, sorted_ptr, act_ptr, h_part_ptr, n_rows,
                k_index, blk * BM, n0, inter, K, top_k, beta, lin_beta)
        if BM == 16:
            _l1_rows(*args, 16, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
        else:
            valid = _valid_rows(sorted_ptr, blk * BM, BM, NW)
            if valid <= 16:
                _l1_rows(*args, 16, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
            elif BM == 32:
                _l1_rows(*args, 32, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
            elif valid <= 32:
                _l1_rows(*args, 32, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
            else:
                _l1_rows(*args, BM, BN, BK, NW, SPLIT, RING, STAGES, ORDER)


@gluon.jit
def l2_regs_kernel(
    act_ptr, w_ptr, s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, slice_stride, latent, K, row_words, row_scales,
    stride_we, stride_se, w_desc,
    BM: gl.constexpr, BK: gl.constexpr, SPLIT: gl.constexpr, num_warps: gl.constexpr, PDL: gl.constexpr = False,
    RING: gl.constexpr = "loads", STAGES: gl.constexpr = 0, ORDER: gl.constexpr = "auto",
):
    NW: gl.constexpr = num_warps
    BN: gl.constexpr = 16 * NW
    # block_expert was written by the grouping, which finished before L1 started: readable before the wait.
    blk, n0, expert, k_index = _program_tile(block_expert_ptr, latent, BN, SPLIT)
    if PDL:
        # Launched as a programmatic dependent of L1 (or its finish): this program's weight rows go to
        # L2 while L1 runs; act is read only after the wait, and nothing is written before it.
        if expert >= 0:
            rows_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
            rows = n0 + gl.arange(0, BN, layout=rows_l)
            k_begin, k_end = _k_slice(K, k_index, SPLIT, BK)
            first = w_ptr + expert.to(gl.int64) * stride_we + rows.to(gl.int64) * row_words + k_begin // 8
            prefetch_rows_l2(first.to(gl.int64), gl.full([BN], 0, gl.int32, layout=rows_l) + (k_end - k_begin) // 2)
        wait_for_predecessor()
    if expert >= 0:
        w_ptrs, s_ptrs = _weight_ptrs(w_ptr, s_ptr, expert, n0, row_words, row_scales, stride_we, stride_se,
                                      BN, BK, NW)
        w_row = expert * (stride_we // row_words) + n0
        args = (act_ptr, w_ptrs, s_ptrs, w_desc, w_row, sorted_ptr, pairs_ptr, slice_stride, k_index, blk * BM, n0,
                latent, K)
        if BM <= 16:  # 8-row blocks: the FP8 L1's (routed_fp8.py), whose grouping L2 then shares
            _l2_rows(*args, BM, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
        else:  # the same test as L1 on the same block: L1 wrote every row this reads
            valid = _valid_rows(sorted_ptr, blk * BM, BM, NW)
            if valid <= 16:
                _l2_rows(*args, 16, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
            elif BM == 32:
                _l2_rows(*args, 32, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
            elif valid <= 32:
                _l2_rows(*args, 32, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
            else:
                _l2_rows(*args, BM, BN, BK, NW, SPLIT, RING, STAGES, ORDER)
