"""One launch for a whole symmetric-memory exchange (ops/symm_exchange.py): peer writes, per-chunk signals, copy-out.

Every rank holds R parts [rows, cols] of its data (part p belongs to rank p) and wants, in a fresh output, the
part addressed to it from every rank (slot r: from rank r). The exchange is cut into chunks (a BLOCK_R x BLOCK_C
tile of a part); program i of every rank handles chunks i, i + G, ... in the same order. Chunk c from rank s has
its own place in the owner's workspace, (s * places + c) * place_elems, whatever the call's shape: its flag
then guards exactly the bytes it names, so exchanges of different shapes one after the other (a prefill, then a
decode step) never overwrite a chunk that its owner has not copied out yet. For each chunk:

    for each peer p:   wait until my busy[p, chunk] is 0 (p has copied out the last exchange's chunk: p cleared
                       it, release), set it to 1, store my part p's chunk into p's workspace place (me, chunk),
                       then set p's ready[me, chunk] to 1 (release, system scope, after a CTA barrier: every
                       thread's stores precede the signal)
    own part:          straight into my output slot me
    for each peer r:   wait for my ready[r, chunk] to be 1 (acquire), copy place (r, chunk) into my output slot r,
                       reset ready, then clear r's busy[me, chunk] (release)

Every wait polls this rank's own memory; across NVLink go only stores (the data and the two flags).

Compared with two workspace barriers around copy kernels (symm_exchange's copy path: five launches for R = 2), a
chunk waits only for the same chunk on its peers, and the exchange is one launch. Deadlock-free while every
program can become resident (G <= the SM count): a program waits only for its peers' programs of the same index,
which wait for nothing but their own previous chunks, and a writer's wait for 0 depends only on the owner's
previous exchange, which finished before its current one started (stream order).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

MAX_CHUNKS = 2048  # ready and busy flags per (peer rank, exchange kind) in every rank's workspace
FLAG_SETS = 2  # ready, busy
MAX_BLOCK_C = 512
MAX_BLOCK_ROWS = 64  # taller chunks would not fit the registers (prepare_symmetric_exchange refuses such sizes)


@triton.jit(do_not_specialize=["rank"])  # rank 1 would become a constant
def peer_exchange_kernel(
    src_ptr, src_part_stride, src_row_stride,  # my part p: src + p * src_part_stride, rows of src_row_stride
    out_ptr, out_slot_stride, out_row_stride,  # my output's slot r: out + r * out_slot_stride
    ws_table, flag_table,  # int64 [R]: every rank's workspace region ([R, places, place_elems]) and flags
    # (int32 [2 R, MAX_CHUNKS]: ready[source, chunk], then busy[owner, chunk])
    places, place_elems, rank, rows, cols, n_col_blocks, n_chunks,
    WORLD: tl.constexpr, MAX_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    r_idx = tl.arange(0, BLOCK_R)
    c_idx = tl.arange(0, BLOCK_C)
    my_ws = tl.load(ws_table + rank).to(tl.pointer_type(dtype))
    my_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    in_chunk = r_idx[:, None] * BLOCK_C + c_idx[None, :]
    for chunk in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
        row = (chunk // n_col_blocks) * BLOCK_R + r_idx
        col = (chunk % n_col_blocks) * BLOCK_C + c_idx
        mask = (row[:, None] < rows) & (col[None, :] < cols)
        src_rc = row[:, None].to(tl.int64) * src_row_stride + col[None, :]
        out_rc = row[:, None].to(tl.int64) * out_row_stride + col[None, :]
        for step in tl.static_range(1, WORLD):
            peer = (rank + step) % WORLD
            part = tl.load(src_ptr + peer.to(tl.int64) * src_part_stride + src_rc, mask=mask)
            # busy[peer, chunk] lives here: the owner clears it (release) once it has copied the last one out
            busy = my_flags + (WORLD + peer) * MAX_CHUNKS + chunk
            while tl.atomic_cas(busy, 0, 0, sem="acquire", scope="sys") != 0:
                pass
            tl.atomic_xchg(busy, 1, sem="relaxed", scope="gpu")
            peer_ws = tl.load(ws_table + peer).to(tl.pointer_type(dtype))
            tl.store(peer_ws + (rank * places + chunk).to(tl.int64) * place_elems + in_chunk, part, mask=mask)
            tl.debug_barrier()
            ready = tl.load(flag_table + peer).to(tl.pointer_type(tl.int32)) + rank * MAX_CHUNKS + chunk
            tl.atomic_xchg(ready, 1, sem="release", scope="sys")
        own = tl.load(src_ptr + rank.to(tl.int64) * src_part_stride + src_rc, mask=mask)
        tl.store(out_ptr + rank.to(tl.int64) * out_slot_stride + out_rc, own, mask=mask)
        for step in tl.static_range(1, WORLD):
            source = (rank + WORLD - step) % WORLD
            ready = my_flags + source * MAX_CHUNKS + chunk
            while tl.atomic_cas(ready, 1, 1, sem="acquire", scope="sys") != 1:
                pass
            tl.debug_barrier()
            part = tl.load(my_ws + (source * places + chunk).to(tl.int64) * place_elems + in_chunk, mask=mask)
            tl.store(out_ptr + source.to(tl.int64) * out_slot_stride + out_rc, part, mask=mask)
            tl.debug_barrier()
            tl.atomic_xchg(ready, 0, sem="relaxed", scope="gpu")
            busy = tl.load(flag_table + source).to(tl.pointer_type(tl.int32)) + (WORLD + rank) * MAX_CHUNKS + chunk
            tl.atomic_xchg(busy, 0, sem="release", scope="sys")


@dataclass(frozen=True)
class Chunks:
    """How one exchange of [rows, cols] parts is cut: block_c-wide tiles (a power of two, at most MAX_BLOCK_C) of
    block_r rows (at most 16 where that keeps within MAX_CHUNKS flags, taller where needed)."""

    block_r: int
    block_c: int
    col_blocks: int
    count: int

    @staticmethod
    def of(rows: int, cols: int) -> Chunks:
        block_c = min(MAX_BLOCK_C, triton.next_power_of_2(cols))
        col_blocks = triton.cdiv(cols, block_c)
        block_r = min(16, triton.next_power_of_2(rows))
        while triton.cdiv(rows, block_r) * col_blocks > MAX_CHUNKS:
            block_r *= 2
        return Chunks(block_r, block_c, col_blocks, triton.cdiv(rows, block_r) * col_blocks)


@dataclass(frozen=True)
class Places:
    """A workspace region's layout for exchanges of up to [max_rows, max_cols] parts: `count` places per source
    rank, each of `elems` elements (enough for every call's chunk index and chunk size)."""

    count: int
    elems: int

    @staticmethod
    def up_to(max_rows: int, max_cols: int) -> Places:
        largest = Chunks.of(max_rows, max_cols)  # block_r and block_c grow with rows and cols
        # A call's chunk count: at most cdiv(rows, 16) row blocks (one below 16 rows), cdiv(cols, MAX_BLOCK_C)
        # column blocks (one below), and MAX_CHUNKS.
        most = triton.cdiv(max_rows, 16) * triton.cdiv(max_cols, MAX_BLOCK_C)
        return Places(min(MAX_CHUNKS, most), largest.block_r * largest.block_c)

    def region_bytes(self, world: int, itemsize: int) -> int:
        return world * self.count * self.elems * itemsize

    def hold(self, chunks: Chunks) -> bool:
        return (chunks.count <= self.count and chunks.block_r * chunks.block_c <= self.elems
                and chunks.block_r <= MAX_BLOCK_ROWS)


def launch_peer_exchange(src, src_part_stride: int, src_row_stride: int, out, out_slot_stride: int,
                         out_row_stride: int, ws_table, flag_table, places: Places, rank: int, world: int, rows: int,
                         cols: int, max_programs: int) -> None:
    """One exchange (module docstring) on the current stream; tables on the output's device; places: the layout
    of the workspace regions the tables point to (in elements of out's dtype)."""
    chunks = Chunks.of(rows, cols)
    if not places.hold(chunks):
        raise ValueError(f"{rows} rows x {cols} columns need {chunks.count} chunks of {chunks.block_r} x "
                         f"{chunks.block_c}, more than the workspace's {places.count} places of {places.elems} "
                         "elements: prepare the symmetric exchange for more tokens")
    grid = (min(chunks.count, max_programs),)
    peer_exchange_kernel[grid](
        src, src_part_stride, src_row_stride, out, out_slot_stride, out_row_stride, ws_table, flag_table,
        places.count, places.elems, rank, rows, cols, chunks.col_blocks, chunks.count,
        WORLD=world, MAX_CHUNKS=MAX_CHUNKS, BLOCK_R=chunks.block_r, BLOCK_C=chunks.block_c,
        num_warps=8 if chunks.block_r * chunks.block_c >= 8192 else 4,
    )
