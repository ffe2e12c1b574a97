"""Routed MXFP4 expert GEMMs for prefill blocks (128 rows, sm_90), warp-specialised and persistent.

The staged kernels (routed_staged.py) have every warp dequantise, pass a CTA barrier and issue its wgmma once per
64-wide k step, so the tensor cores wait whenever any warp's dequantisation or loads run late. Here the work of a
step is split between partitions that hand buffers to each other through mbarriers:

- loader (L2: 1 warp; L1: 4 warps): the weight words of the step by TMA, the activation rows by TMA (L2: a block's
  rows are contiguous) or by cp.async (L1: the rows of z gathered by token), each into a ring of S stages;
- dequantiser (4 warps): the words of a stage -> the bf16 weight tile of the same stage (lut_dequant's bit placement,
  as the staged kernels: same values, same k order);
- MMA (the default partition, 8 warps = two warp groups of 64 weight rows): waits for a stage's tile and
  activations, issues its wgmma asynchronously, waits for the one before and gives that stage back; the epilogue
  after a tile's last step, while the loader and dequantiser already fill the ring with the next tile's steps.

The grid is one CTA per SM looping over the (block, weight-row tile) pairs, block-major as the staged kernels'
programs; unused blocks (expert -1) are skipped by every partition alike. A block with at most 64 valid rows runs
the MMA with N = 64 (the same values as N = 128 on its first rows). The FP32 sums group k as the staged kernels do
(16-wide MMA chunks in natural k order): the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...common.triton_compat import cta_barrier
from .lut_dequant import WINDOW_SCALE
from .routed_gemm import _valid_rows, store_pair_rows
from .routed_staged import _act_layout, _dequant_tile, _scale_ptrs, _words_layout, store_situ_rows

_UNWINDOW = gl.constexpr(WINDOW_SCALE)
BN: gl.constexpr = gl.constexpr(128)  # weight rows per tile (L1: 64 gate + 64 up)
BM: gl.constexpr = gl.constexpr(128)  # rows per expert block
MMA_WARPS: gl.constexpr = gl.constexpr(8)
# Loader partitions (setmaxnreg counts; the dequantiser and the MMA warps get the rest of the register file): L1
# gathers its z rows by cp.async over 4 warps (8 row pointers a thread), L2's rows come by TMA from one warp.
LOADER_WARPS_L1: gl.constexpr = gl.constexpr(4)
LOADER_REGS_L1: gl.constexpr = gl.constexpr(80)
LOADER_REGS_L2: gl.constexpr = gl.constexpr(40)


@gluon.jit
def _column_tiles(n_total, GATED: gl.constexpr):
    """Column tiles per block: L1 (GATED) BN / 2 weight columns a tile (their gate and up rows), L2 BN."""
    return n_total // (BN // 2) if GATED else n_total // BN


@gluon.jit
def _tile(t, tiles_n, block_expert_ptr):
    """Tile t's block, its column tile (of BN / 2 weight columns in L1, BN in L2; tiles_n of them) and expert."""
    blk = t // tiles_n
    return blk, t % tiles_n, gl.load(block_expert_ptr + blk)


@gluon.jit
def _words_rows(col, n_total, GATED: gl.constexpr, NW: gl.constexpr):
    """The weight rows of the tile's words, in the words layout's row order (L1: gate rows, then up rows)."""
    rn = gl.arange(0, BN, layout=gl.SliceLayout(1, _words_layout(BN, NW)))
    if GATED:
        n0 = col * (BN // 2)
        rows = gl.where(rn < BN // 2, n0 + rn, n_total + n0 + rn - BN // 2)
    else:
        rows = col * BN + rn
    return rows


@gluon.jit
def _load_words(w_desc, word_stages, words_ready, words_empty, g, expert, col, n_total, k, GATED: gl.constexpr,
                S: gl.constexpr):
    """Global step g's weight words into ring stage g % S by TMA, once the dequantiser has given the stage back."""
    st = g % S
    mbarrier.wait(words_empty.index(st), ((g // S) & 1) ^ 1)
    mbarrier.expect(words_ready.index(st), w_desc.block_type.nbytes)
    if GATED:
        coord = [2 * expert, col * (BN // 2), k // 8]
    else:
        coord = [expert * n_total + col * BN, k // 8]
    tma.async_copy_global_to_shared(w_desc, coord, words_ready.index(st), word_stages.index(st))


@gluon.jit
def _l2_loader(w_desc, a_desc, word_stages, acts, words_ready, words_empty, act_ready, act_empty, block_expert_ptr,
               latent, K, num_tiles, S: gl.constexpr):
    tiles_n = _column_tiles(latent, False)
    n_steps = K // 64
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, col, expert = _tile(t, tiles_n, block_expert_ptr)
        if expert >= 0:
            for i in range(n_steps):
                _load_words(w_desc, word_stages, words_ready, words_empty, g, expert, col, latent, i * 64, False, S)
                st = g % S
                mbarrier.wait(act_empty.index(st), ((g // S) & 1) ^ 1)
                mbarrier.expect(act_ready.index(st), a_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [blk * BM, i * 64], act_ready.index(st), acts.index(st))
                g += 1


@gluon.jit
def _l1_loader(w_desc, z_ptr, sorted_ptr, word_stages, acts, words_ready, words_empty, act_ready, act_empty,
               block_expert_ptr, inter, K, top_k, num_tiles, S: gl.constexpr):
    NW: gl.constexpr = LOADER_WARPS_L1
    act_l: gl.constexpr = _act_layout(NW)
    ak = gl.arange(0, 64, layout=gl.SliceLayout(0, act_l))
    tiles_n = _column_tiles(inter, True)
    n_steps = K // 64
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, col, expert = _tile(t, tiles_n, block_expert_ptr)
        if expert >= 0:
            pair = gl.load(sorted_ptr + blk * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, act_l)))
            tok = gl.where(pair >= 0, pair // top_k, 0)
            a_rows = (z_ptr + tok.to(gl.int64) * K)[:, None]
            a_mask = (pair >= 0)[:, None]
            for i in range(n_steps):
                _load_words(w_desc, word_stages, words_ready, words_empty, g, expert, col, inter, i * 64, True, S)
                st = g % S
                mbarrier.wait(act_empty.index(st), ((g // S) & 1) ^ 1)
                async_copy.async_copy_global_to_shared(acts.index(st), a_rows + (i * 64 + ak)[None, :], mask=a_mask)
                # each thread's arrival (128 a phase) once its copies of the step have landed
                async_copy.mbarrier_arrive(act_ready.index(st), increment_count=False)
                g += 1


@gluon.jit
def _dequantiser(word_stages, weight_tiles, words_ready, words_empty, tile_ready, tile_empty, s_ptr,
                 block_expert_ptr, n_total, K, row_scales, stride_se, num_tiles, GATED: gl.constexpr, S: gl.constexpr,
                 NW: gl.constexpr):
    tiles_n = _column_tiles(n_total, GATED)
    n_steps = K // 64
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, col, expert = _tile(t, tiles_n, block_expert_ptr)
        if expert >= 0:
            s_ptrs = _scale_ptrs(s_ptr, expert, _words_rows(col, n_total, GATED, NW), row_scales, stride_se,
                                 BN, NW)
            sc = gl.load(s_ptrs)
            for i in range(n_steps):
                st = g % S
                phase = (g // S) & 1
                mbarrier.wait(words_ready.index(st), phase)
                stage = word_stages.index(st)
                if GATED:
                    stage = stage._reinterpret(gl.int32, [BN, 8],
                                               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
                words = stage.load(_words_layout(BN, NW))
                sc_next = gl.load(s_ptrs + (gl.minimum(i + 1, n_steps - 1) * 64) // 32)
                cta_barrier()  # every warp of the partition has read the stage's words
                mbarrier.arrive(words_empty.index(st), count=1)
                tile = _dequant_tile(words, sc, BN)
                mbarrier.wait(tile_empty.index(st), phase ^ 1)
                weight_tiles.index(st).store(tile)
                fence_async_shared()  # the tile's stores (generic proxy) before the wgmma's reads (async proxy)
                cta_barrier()
                mbarrier.arrive(tile_ready.index(st), count=1)
                sc = sc_next
                g += 1


@gluon.jit
def _mma_steps(weight_tiles, acts, tile_ready, tile_empty, act_ready, act_empty, g, n_steps, ROWS: gl.constexpr,
               S: gl.constexpr):
    """acc [BN, ROWS] of one tile over its n_steps ring stages from g on; every stage given back."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                    instr_shape=[16, ROWS, 16])
    acc = gl.zeros([BN, ROWS], gl.float32, layout=mma_l)
    for i in range(n_steps):
        st = g % S
        phase = (g // S) & 1
        mbarrier.wait(tile_ready.index(st), phase)
        mbarrier.wait(act_ready.index(st), phase)
        act = acts.index(st)
        if ROWS < BM:
            act = act.slice(0, ROWS)
        acc = warpgroup_mma(weight_tiles.index(st), act.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        cta_barrier()  # both warp groups have seen the step before's wgmma complete
        prev = (g + S - 1) % S
        mbarrier.arrive(tile_empty.index(prev), count=1, pred=i > 0)
        mbarrier.arrive(act_empty.index(prev), count=1, pred=i > 0)
        g += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    cta_barrier()
    last = (g + S - 1) % S
    mbarrier.arrive(tile_empty.index(last), count=1)
    mbarrier.arrive(act_empty.index(last), count=1)
    return acc * _UNWINDOW, g


@gluon.jit
def _store_tile(acc, out_ptr, sorted_ptr, row0, col, n_total, beta, lin_beta, ROWS: gl.constexpr,
                GATED: gl.constexpr):
    """The tile's epilogue: L1 (GATED) the SiTU act rows of its BN / 2 columns, L2 the FP32 pair rows of its BN."""
    if GATED:
        store_situ_rows(acc, out_ptr, row0, col * (BN // 2), n_total, beta, lin_beta, ROWS, MMA_WARPS)
    else:
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                        instr_shape=[16, ROWS, 16])
        store_pair_rows(acc, out_ptr, sorted_ptr, row0, col * BN, n_total, mma_l, ROWS, BN)


@gluon.jit
def _mma_partition(weight_tiles, acts, tile_ready, tile_empty, act_ready, act_empty, block_expert_ptr, sorted_ptr,
                   out_ptr, n_total, K, beta, lin_beta, num_tiles, S: gl.constexpr, GATED: gl.constexpr):
    """The default partition: every tile's steps from the rings (N = 64 for blocks with at most 64 valid rows), then
    its epilogue while the other partitions fill the rings with the next tile's."""
    tiles_n = _column_tiles(n_total, GATED)
    n_steps = K // 64
    g = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, col, expert = _tile(t, tiles_n, block_expert_ptr)
        if expert >= 0:
            if _valid_rows(sorted_ptr, blk * BM, BM, MMA_WARPS) <= BM // 2:
                half, g = _mma_steps(weight_tiles, acts, tile_ready, tile_empty, act_ready, act_empty, g, n_steps,
                                     BM // 2, S)
                _store_tile(half, out_ptr, sorted_ptr, blk * BM, col, n_total, beta, lin_beta, BM // 2, GATED)
            else:
                full, g = _mma_steps(weight_tiles, acts, tile_ready, tile_empty, act_ready, act_empty, g, n_steps,
                                     BM, S)
                _store_tile(full, out_ptr, sorted_ptr, blk * BM, col, n_total, beta, lin_beta, BM, GATED)


@gluon.jit
def _ring_barriers(S: gl.constexpr, ACT_ARRIVALS: gl.constexpr):
    """The rings' ready / empty mbarriers (S stages each): words, weight tiles, activations; one arrival a phase
    except the activations' ready (ACT_ARRIVALS: 1 for a TMA copy, a loader thread each for cp.async)."""
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    bars = (gl.allocate_shared_memory(gl.int64, [S, 1], bar_l), gl.allocate_shared_memory(gl.int64, [S, 1], bar_l),
            gl.allocate_shared_memory(gl.int64, [S, 1], bar_l), gl.allocate_shared_memory(gl.int64, [S, 1], bar_l),
            gl.allocate_shared_memory(gl.int64, [S, 1], bar_l), gl.allocate_shared_memory(gl.int64, [S, 1], bar_l))
    for st in gl.static_range(S):
        for b in gl.static_range(6):
            mbarrier.init(bars[b].index(st), count=ACT_ARRIVALS if b == 4 else 1)
    return bars


@gluon.jit(do_not_specialize=["top_k"])
def l1_ws_kernel(z_ptr, s_ptr, sorted_ptr, block_expert_ptr, act_ptr, inter, K, row_scales, top_k, stride_se, beta,
                 lin_beta, num_tiles, w_desc, STAGES: gl.constexpr, DEQUANT_WARPS: gl.constexpr,
                 DEQUANT_REGS: gl.constexpr, num_warps: gl.constexpr):
    """act[block rows, n0 .. n0 + 64] = bf16(SiTU(gate, up)) for every (block, 64 columns) tile, persistent."""
    S: gl.constexpr = STAGES
    op_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    word_stages = gl.allocate_shared_memory(w_desc.dtype, [S] + w_desc.block_type.shape, w_desc.layout)
    weight_tiles = gl.allocate_shared_memory(gl.bfloat16, [S, BN, 64], op_l)
    acts = gl.allocate_shared_memory(gl.bfloat16, [S, BM, 64], op_l)
    # one cp.async arrival per loader thread
    words_ready, words_empty, tile_ready, tile_empty, act_ready, act_empty = _ring_barriers(S, LOADER_WARPS_L1 * 32)
    gl.warp_specialize([
        (_mma_partition, (weight_tiles, acts, tile_ready, tile_empty, act_ready, act_empty, block_expert_ptr,
                          sorted_ptr, act_ptr, inter, K, beta, lin_beta, num_tiles, S, True)),
        (_l1_loader, (w_desc, z_ptr, sorted_ptr, word_stages, acts, words_ready, words_empty, act_ready, act_empty,
                      block_expert_ptr, inter, K, top_k, num_tiles, S)),
        (_dequantiser, (word_stages, weight_tiles, words_ready, words_empty, tile_ready, tile_empty, s_ptr,
                        block_expert_ptr, inter, K, row_scales, stride_se, num_tiles, True, S, DEQUANT_WARPS)),
    ], [LOADER_WARPS_L1, DEQUANT_WARPS], [LOADER_REGS_L1, DEQUANT_REGS])


@gluon.jit
def l2_ws_kernel(s_ptr, sorted_ptr, block_expert_ptr, pairs_ptr, latent, K, row_scales, stride_se, num_tiles, w_desc,
                 a_desc, STAGES: gl.constexpr, DEQUANT_WARPS: gl.constexpr, DEQUANT_REGS: gl.constexpr,
                 num_warps: gl.constexpr):
    """pairs[pair of row, n0 .. n0 + 128] = act[row] @ W2^T (FP32) for every (block, 128 rows of W2) tile,
    persistent."""
    S: gl.constexpr = STAGES
    op_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    word_stages = gl.allocate_shared_memory(w_desc.dtype, [S] + w_desc.block_type.shape, w_desc.layout)
    weight_tiles = gl.allocate_shared_memory(gl.bfloat16, [S, BN, 64], op_l)
    acts = gl.allocate_shared_memory(a_desc.dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    words_ready, words_empty, tile_ready, tile_empty, act_ready, act_empty = _ring_barriers(S, 1)  # one TMA arrival
    gl.warp_specialize([
        (_mma_partition, (weight_tiles, acts, tile_ready, tile_empty, act_ready, act_empty, block_expert_ptr,
                          sorted_ptr, pairs_ptr, latent, K, 0.0, 0.0, num_tiles, S, False)),
        (_l2_loader, (w_desc, a_desc, word_stages, acts, words_ready, words_empty, act_ready, act_empty,
                      block_expert_ptr, latent, K, num_tiles, S)),
        (_dequantiser, (word_stages, weight_tiles, words_ready, words_empty, tile_ready, tile_empty, s_ptr,
                        block_expert_ptr, latent, K, row_scales, stride_se, num_tiles, False, S, DEQUANT_WARPS)),
    ], [1, DEQUANT_WARPS], [LOADER_REGS_L2, DEQUANT_REGS])
