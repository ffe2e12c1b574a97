"""CuTe DSL kernel of the latent tail for Hopper (sm_90a): TMA-fed WGMMA mainloop + fragment-reducing epilogue.

    out[M, N] = round(fp32(Y[M, K] @ W[N, K]^T) + F[0, M, N] + ... + F[R-1, M, N])

Y and W are K-major (row-major, unit inner stride); F is any [R, M, N] view with unit stride along N
(the three fragment layouts all are); out is row-major. M, N, K and the strides are run-time values,
so one compiled kernel serves every M; R and the tile configuration are compile-time.

Mainloop: warp 0 issues TMA loads of (rows x 64) K-slices of both operands into a `stages`-deep ring
of 128-byte-swizzled shared-memory buffers, each completing on a full-barrier (mbarrier with a
transaction count); all warpgroups wait on it, issue WGMMAs (fp32 accumulators in registers), and
release the slot of the previous K step once `wgmma.wait_group 1` says its reads are done.
With swap_ab the MMA computes out^T tiles: W rows fill the 64-wide M slot, tokens the N slot.

Programmatic dependent launch (pdl, compile-time): launched with programmatic stream serialisation, the
kernel may start while the kernel before it (the producer's combine, which signals early) still runs. Warp 0
then loads the weight tiles of the first `stages` K steps, which nothing before writes, executes
`griddepcontrol.wait`, and only then loads the token tiles into the same stages (each stage's barrier expects
both); every other thread waits before it reads anything (the epilogue's fragments) or writes.

Epilogue: the accumulators are staged as fp32 in the (now idle) pipeline buffers, laid out with the
output's hidden dimension contiguous whichever orientation the MMA had; then each thread takes
8 consecutive outputs of one token row: 16-byte loads of every fragment, an fp32 sum in the order
acc + F[0] + ... + F[R-1], one rounding, one 16-byte store. Rows past M are skipped (the TMA loads
past M read zeros), so M needs no padding.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.tensor_utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from .tail_configs import EPI_PAD, TILE_K, VEC, CuteTailConfig


class TailKernelSm90:
    def __init__(self, cfg: CuteTailConfig, io_dtype: type[cutlass.Numeric], num_frags: int, pdl: bool = False):
        cfg.check()
        if num_frags < 1:
            raise ValueError(f"num_frags must be >= 1, got {num_frags}")
        self.cfg = cfg
        self.io_dtype = io_dtype
        self.acc_dtype = cutlass.Float32
        self.num_frags = num_frags
        self.pdl = pdl
        self.tile_mnk = (cfg.mma_m, cfg.mma_n, TILE_K)
        self.threads = cfg.threads
        self.stages = cfg.stages
        self.epi_tokens = cfg.tokens_per_tile
        self.epi_hidden = cfg.hidden_per_tile
        self.epi_pitch = cfg.hidden_per_tile + EPI_PAD  # fp32 elements per staged token row

    # ------------------------------------------------------------------ host side (traced once per compile)
    @cute.jit
    def __call__(
        self,
        y_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        f_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        m: cutlass.Int32,
        n: cutlass.Int32,
        k: cutlass.Int32,
        y_ld: cutlass.Int32,
        w_ld: cutlass.Int32,
        f_stride_r: cutlass.Int32,
        f_stride_m: cutlass.Int32,
        out_ld: cutlass.Int32,
        stream,
    ):
        # Strides are multiples of 8 elements (16 bytes), checked by the caller: telling the compiler
        # lets the epilogue use 16-byte accesses and the TMA descriptors their aligned form.
        y_ld = cute.assume(y_ld, divby=VEC)
        w_ld = cute.assume(w_ld, divby=VEC)
        f_stride_r = cute.assume(f_stride_r, divby=VEC)
        f_stride_m = cute.assume(f_stride_m, divby=VEC)
        out_ld = cute.assume(out_ld, divby=VEC)
        m_y = cute.make_tensor(y_ptr, cute.make_layout((m, k), stride=(y_ld, 1)))
        m_w = cute.make_tensor(w_ptr, cute.make_layout((n, k), stride=(w_ld, 1)))
        m_f = cute.make_tensor(
            f_ptr, cute.make_layout((m, n, self.num_frags), stride=(f_stride_m, 1, f_stride_r))
        )
        m_out = cute.make_tensor(out_ptr, cute.make_layout((m, n), stride=(out_ld, 1)))
        m_a, m_b = (m_w, m_y) if self.cfg.swap_ab else (m_y, m_w)

        k_major = cutlass.tensor_utils.LayoutEnum.ROW_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.io_dtype,
            self.io_dtype,
            k_major.sm90_mma_major_mode(),
            k_major.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.cfg.warpgroups, 1, 1),
            tiler_mn=(64, self.cfg.mma_n),
        )
        a_layout = sm90_utils.make_smem_layout_a(k_major, self.tile_mnk, self.io_dtype, self.stages)
        b_layout = sm90_utils.make_smem_layout_b(k_major, self.tile_mnk, self.io_dtype, self.stages)
        tma_a, tma_m_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            m_a,
            cute.slice_(a_layout, (None, None, 0)),
            (self.cfg.mma_m, TILE_K),
        )
        tma_b, tma_m_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(),
            m_b,
            cute.slice_(b_layout, (None, None, 0)),
            (self.cfg.mma_n, TILE_K),
        )

        elem_bytes = self.io_dtype.width // 8
        self.a_bytes = cute.cosize(a_layout) * elem_bytes
        ab_bytes = self.a_bytes + cute.cosize(b_layout) * elem_bytes
        epi_bytes = self.epi_tokens * self.epi_pitch * 4
        buf_bytes = max(ab_bytes, epi_bytes)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            buf: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, buf_bytes], 1024]

        self.shared_storage = SharedStorage

        grid_m = (m_a.shape[0] + self.cfg.mma_m - 1) // self.cfg.mma_m
        grid_n = (m_b.shape[0] + self.cfg.mma_n - 1) // self.cfg.mma_n
        self.kernel(tma_a, tma_m_a, tma_b, tma_m_b, m_f, m_out, tiled_mma, a_layout, b_layout).launch(
            grid=(grid_m, grid_n, 1),
            block=[self.threads, 1, 1],
            stream=stream,
            use_pdl=self.pdl,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        m_a: cute.Tensor,
        tma_b: cute.CopyAtom,
        m_b: cute.Tensor,
        m_f: cute.Tensor,
        m_out: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        tile_a, tile_b, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        buf = storage.buf.data_ptr()
        s_a = cute.make_tensor(cute.recast_ptr(buf, a_layout.inner, dtype=self.io_dtype), a_layout.outer)
        s_b = cute.make_tensor(
            cute.recast_ptr(buf + self.a_bytes, b_layout.inner, dtype=self.io_dtype), b_layout.outer
        )

        # Full barriers: one TMA thread arms each with the stage's byte count. Empty barriers: one
        # arrival per consumer warp.
        stage_bytes = cute.size_in_bytes(self.io_dtype, cute.slice_(a_layout, (None, None, 0))) + cute.size_in_bytes(
            self.io_dtype, cute.slice_(b_layout, (None, None, 0))
        )
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )

        # (rows, TILE_K, k_tiles) global views of this CTA's operand rows, partitioned for TMA.
        g_a = cute.local_tile(m_a, (self.cfg.mma_m, TILE_K), (tile_a, None))
        g_b = cute.local_tile(m_b, (self.cfg.mma_n, TILE_K), (tile_b, None))
        t_sa, t_ga = cpasync.tma_partition(
            tma_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2)
        )
        t_sb, t_gb = cpasync.tma_partition(
            tma_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2)
        )
        k_tiles = cute.size(g_a, mode=[2])

        # WGMMA operands are shared-memory descriptors, partitioned per warpgroup.
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_wg = tiled_mma.get_slice(wg * 128)
        frag_a = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(s_a))
        frag_b = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(s_b))
        thr_mma = tiled_mma.get_slice(tidx)
        acc_view = cute.make_identity_tensor((self.cfg.mma_m, self.cfg.mma_n))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(acc_view).shape, self.acc_dtype)
        k_blocks = cute.size(frag_a, mode=[2])

        producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # Under swap-AB the MMA's A operand is the weight, else its B.
        weights = (tma_a, t_ga, t_sa) if cutlass.const_expr(self.cfg.swap_ab) else (tma_b, t_gb, t_sb)
        tokens = (tma_b, t_gb, t_sb) if cutlass.const_expr(self.cfg.swap_ab) else (tma_a, t_ga, t_sa)
        if warp == 0:
            if cutlass.const_expr(self.pdl):
                early = producer.clone()
                for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                    ring.producer_acquire(early)  # arms the stage for both operands' bytes
                    self._copy(ring, early, *weights)
                    early.advance()
                cute.arch.griddepcontrol_wait()
                for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                    self._copy(ring, producer, *tokens)
                    ring.producer_commit(producer)
                    producer.advance()
            else:
                for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                    self._load_stage(ring, producer, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb)
                    producer.advance()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # every thread, before it reads the fragments or writes

        reader = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        releaser = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        # First K step overwrites the accumulators; later steps accumulate.
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        ring.consumer_wait(reader)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, frag_a[(None, None, kb, reader.index)], frag_b[(None, None, kb, reader.index)], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        reader.advance()

        for _ in cutlass.range(1, k_tiles, 1, unroll=1):
            ring.consumer_wait(reader)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(
                    tiled_mma, acc, frag_a[(None, None, kb, reader.index)], frag_b[(None, None, kb, reader.index)], acc
                )
            warpgroup.commit_group()
            # The previous step's WGMMAs have read their operands: hand that slot back to TMA.
            warpgroup.wait_group(1)
            ring.consumer_release(releaser)
            releaser.advance()
            reader.advance()
            if warp == 0 and producer.count < k_tiles:
                self._load_stage(ring, producer, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb)
                producer.advance()

        warpgroup.wait_group(0)
        # Every warp is done with the operand buffers before they are reused as the fp32 staging.
        cute.arch.sync_threads()
        self._epilogue(buf, thr_mma, acc, m_f, m_out, tile_a, tile_b, tidx)

    @cute.jit
    def _copy(self, ring, state, tma, t_g, t_s):
        cute.copy(tma, t_g[(None, state.count)], t_s[(None, state.index)], tma_bar_ptr=ring.producer_get_barrier(state))

    @cute.jit
    def _load_stage(self, ring, state, tma_a, t_ga, t_sa, tma_b, t_gb, t_sb):
        ring.producer_acquire(state)
        self._copy(ring, state, tma_a, t_ga, t_sa)
        self._copy(ring, state, tma_b, t_gb, t_sb)
        ring.producer_commit(state)

    @cute.jit
    def _epilogue(self, buf, thr_mma, acc, m_f, m_out, tile_a, tile_b, tidx):
        staged = cute.recast_ptr(buf, dtype=self.acc_dtype)
        # The staging holds (tokens, hidden) rows with hidden contiguous; the MMA's view of it is
        # transposed under swap-AB.
        if cutlass.const_expr(self.cfg.swap_ab):
            mma_view = cute.make_layout((self.cfg.mma_m, self.cfg.mma_n), stride=(1, self.epi_pitch))
            tok0 = tile_b * self.epi_tokens
            hid0 = tile_a * self.epi_hidden
        else:
            mma_view = cute.make_layout((self.cfg.mma_m, self.cfg.mma_n), stride=(self.epi_pitch, 1))
            tok0 = tile_a * self.epi_tokens
            hid0 = tile_b * self.epi_hidden
        t_stage = thr_mma.partition_C(cute.make_tensor(staged, mma_view))
        t_stage.store(acc.load())
        cute.arch.sync_threads()

        vecs_per_row = self.epi_hidden // VEC
        rows_per_pass = self.threads // vecs_per_row
        passes = (self.epi_tokens + rows_per_pass - 1) // rows_per_pass
        row_in_pass = tidx // vecs_per_row
        col = tidx % vecs_per_row
        m = m_out.shape[0]
        for p in cutlass.range_constexpr(passes):
            row = p * rows_per_pass + row_in_pass
            tok = tok0 + row
            if row < self.epi_tokens and tok < m:
                s_row = cute.make_tensor(staged + row * self.epi_pitch + col * VEC, cute.make_layout(VEC))
                total = s_row.load()
                vec_idx = hid0 // VEC + col
                for r in cutlass.range_constexpr(self.num_frags):
                    frag = cute.local_tile(m_f, (1, VEC, 1), (tok, vec_idx, r))[0, None, 0]
                    total = total + frag.load().to(self.acc_dtype)
                out = cute.local_tile(m_out, (1, VEC), (tok, vec_idx))[0, None]
                out.store(total.to(self.io_dtype))
