"""One launch for a whole symmetric-memory exchange (ops/common/symm_exchange.py): peer writes, one signal per program and
peer, copy-out.

Every rank holds R parts [rows, cols] of its data (part p belongs to rank p) and wants, in a fresh output, the
part addressed to it from every rank (slot r: from rank r). The exchange is cut into chunks (a BLOCK_R x BLOCK_C
tile of a part); program i of G (G fixed per exchange kind for the workspace's life, the same on every rank)
handles chunks i, i + G, ..., its j-th into its own place (source, i * per_program + j) of the owner's workspace:

    push       for each peer p: wait until my busy[p, i] is 0 (p has copied out what program i sent it last time,
               whatever the shapes were), set it; store all of my chunks of part p into p's places (me, i, .);
               after a CTA barrier, set p's ready[me, i] (release, system scope): one signal for all of them
    own part   my chunks of part me straight into my output slot me
    pull       for each peer r: wait for my ready[r, i] (acquire), copy places (r, i, .) into my output slot r,
               reset ready, clear r's busy[me, i] (release)

Every wait polls this rank's own memory; across NVLink go only stores (the data and one flag store per program,
peer and direction). No program waits for anything of the current exchange before it has pushed all of its
chunks, so no peer can wait for a push that waits for it: the pulls end once every peer program has run. A first
version signalled each chunk, which chained a system-scope release and its round trip per chunk: on one GPU with
two ranks as streams, 16 programs took 543 us for a 4096-token gather that moves 290 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

MAX_CHUNKS = 2048  # chunks of one exchange
MAX_PROGRAMS = 256  # ready and busy flags per (peer rank, exchange kind) in every rank's workspace
FLAG_SETS = 2  # ready, busy
MAX_BLOCK_C = 512
MAX_BLOCK_ROWS = 64  # taller chunks would not fit the registers (prepare_symmetric_exchange refuses such sizes)


@triton.jit
def _chunk_tile(chunk, n_col_blocks, rows, cols, src_row_stride, out_row_stride, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Chunk `chunk`'s element offsets in a part (src_rc) and in an output slot (out_rc), and its in-bounds mask."""
    row = (chunk // n_col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = (chunk % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (row[:, None] < rows) & (col[None, :] < cols)
    row64 = row[:, None].to(tl.int64)
    return row64 * src_row_stride + col[None, :], row64 * out_row_stride + col[None, :], mask


@triton.jit(do_not_specialize=["rank"])  # rank 1 would become a constant
def peer_exchange_kernel(
    src_ptr, src_part_stride, src_row_stride,  # my part p: src + p * src_part_stride, rows of src_row_stride
    out_ptr, out_slot_stride, out_row_stride,  # my output's slot r: out + r * out_slot_stride
    ws_table, flag_table,  # int64 [R]: every rank's workspace region ([R, places, place_elems]) and flags
    # (int32 [2 R, MAX_PROGRAMS]: ready[source, program], then busy[owner, program])
    places, per_program, place_elems, rank, rows, cols, n_col_blocks, n_chunks,
    WORLD: tl.constexpr, MAX_PROGRAMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    in_chunk = tl.arange(0, BLOCK_R)[:, None] * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    my_ws = tl.load(ws_table + rank).to(tl.pointer_type(dtype))
    my_flags = tl.load(flag_table + rank).to(tl.pointer_type(tl.int32))
    first_place = pid * per_program
    for step in tl.static_range(1, WORLD):
        peer = (rank + step) % WORLD
        busy = my_flags + (WORLD + peer) * MAX_PROGRAMS + pid
        while tl.atomic_cas(busy, 0, 0, sem="acquire", scope="sys") != 0:
            pass
        tl.atomic_xchg(busy, 1, sem="relaxed", scope="gpu")
        places_at_peer = tl.load(ws_table + peer).to(tl.pointer_type(dtype)) + (rank * places).to(tl.int64) * place_elems
        for chunk in range(pid, n_chunks, programs):
            src_rc, _, mask = _chunk_tile(chunk, n_col_blocks, rows, cols, src_row_stride, out_row_stride, BLOCK_R,
                                          BLOCK_C)
            part = tl.load(src_ptr + peer.to(tl.int64) * src_part_stride + src_rc, mask=mask)
            place = (first_place + chunk // programs).to(tl.int64) * place_elems
            tl.store(places_at_peer + place + in_chunk, part, mask=mask)
        tl.debug_barrier()
        ready = tl.load(flag_table + peer).to(tl.pointer_type(tl.int32)) + rank * MAX_PROGRAMS + pid
        tl.atomic_xchg(ready, 1, sem="release", scope="sys")
    for chunk in range(pid, n_chunks, programs):
        src_rc, out_rc, mask = _chunk_tile(chunk, n_col_blocks, rows, cols, src_row_stride, out_row_stride, BLOCK_R,
                                           BLOCK_C)
        own = tl.load(src_ptr + rank.to(tl.int64) * src_part_stride + src_rc, mask=mask)
        tl.store(out_ptr + rank.to(tl.int64) * out_slot_stride + out_rc, own, mask=mask)
    for step in tl.static_range(1, WORLD):
        source = (rank + WORLD - step) % WORLD
        ready = my_flags + source * MAX_PROGRAMS + pid
        while tl.atomic_cas(ready, 1, 1, sem="acquire", scope="sys") != 1:
            pass
        tl.debug_barrier()
        places_here = my_ws + (source * places).to(tl.int64) * place_elems
        for chunk in range(pid, n_chunks, programs):
            _, out_rc, mask = _chunk_tile(chunk, n_col_blocks, rows, cols, src_row_stride, out_row_stride, BLOCK_R,
                                          BLOCK_C)
            place = (first_place + chunk // programs).to(tl.int64) * place_elems
            part = tl.load(places_here + place + in_chunk, mask=mask)
            tl.store(out_ptr + source.to(tl.int64) * out_slot_stride + out_rc, part, mask=mask)
        tl.debug_barrier()
        tl.atomic_xchg(ready, 0, sem="relaxed", scope="gpu")
        busy = tl.load(flag_table + source).to(tl.pointer_type(tl.int32)) + (WORLD + rank) * MAX_PROGRAMS + pid
        tl.atomic_xchg(busy, 0, sem="release", scope="sys")


@dataclass(frozen=True)
class Chunks:
    """How one exchange of [rows, cols] parts is cut: block_c-wide tiles (a power of two, at most MAX_BLOCK_C) of
    block_r rows (at most 16 where that keeps within MAX_CHUNKS chunks, taller where needed)."""

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
        # + MAX_PROGRAMS: room for every program's share rounded up (per_program = count // programs)
        return Places(min(MAX_CHUNKS, most) + MAX_PROGRAMS, largest.block_r * largest.block_c)

    def region_bytes(self, world: int, itemsize: int) -> int:
        return world * self.count * self.elems * itemsize

    def hold(self, chunks: Chunks, programs: int) -> bool:
        return (triton.cdiv(chunks.count, programs) <= self.count // programs and programs <= MAX_PROGRAMS
                and chunks.block_r * chunks.block_c <= self.elems and chunks.block_r <= MAX_BLOCK_ROWS)


def launch_peer_exchange(src, src_part_stride: int, src_row_stride: int, out, out_slot_stride: int,
                         out_row_stride: int, ws_table, flag_table, places: Places, rank: int, world: int, rows: int,
                         cols: int, programs: int) -> None:
    """One exchange (module docstring) on the current stream; tables on the output's device; places: the layout
    of the workspace regions the tables point to (in elements of out's dtype); programs: this exchange kind's
    fixed grid (every rank, every call)."""
    chunks = Chunks.of(rows, cols)
    if not places.hold(chunks, programs):
        raise ValueError(f"{rows} rows x {cols} columns need {chunks.count} chunks of {chunks.block_r} x "
                         f"{chunks.block_c}, more than the workspace's {places.count} places of {places.elems} "
                         "elements: prepare the symmetric exchange for more tokens")
    peer_exchange_kernel[(programs,)](
        src, src_part_stride, src_row_stride, out, out_slot_stride, out_row_stride, ws_table, flag_table,
        places.count, places.count // programs, places.elems, rank, rows, cols, chunks.col_blocks, chunks.count,
        WORLD=world, MAX_PROGRAMS=MAX_PROGRAMS, BLOCK_R=chunks.block_r, BLOCK_C=chunks.block_c,
        num_warps=8 if chunks.block_r * chunks.block_c >= 8192 else 4,
    )
