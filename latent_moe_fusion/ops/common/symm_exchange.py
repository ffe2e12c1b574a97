"""Symmetric-memory fragment publication and output all-gather for R > 1 on CUDA (docs/design.md, section 2:
"symmetric-memory peer writes where available"). layouts.py's torch.distributed movement is the reference; these
paths move the same bytes to the same places, so the ops' outputs are bitwise those of the reference path.

    lmf.prepare_symmetric_exchange(group, max_tokens=4096, hidden=7168)   # collective, once, before capture

allocates one symmetric workspace per group (`torch.distributed._symmetric_memory`: every rank maps every peer's
buffer; unicast stores only, NVLink multicast is never used) and rendezvouses it. From then on, where the token
count lies in the measured window (`WINDOWS`, per method and kind), the producers publish
their shared fragments by peer writes into the owners' workspaces and the hidden_scatter tail gathers its output
column slices the same way. One exchange on rank q, on the stream that made the data, in one Triton launch with
`method = "kernel"` (peer_exchange.py: one signal per program and peer, in the workspace's flags):

    peer writes   owner p's workspace receives q's part for p, each program's share once p has copied out what
                  that program sent last time (its flag back at 0), then signalled (flag 1, release at system scope)
    copy out      q's own part and, as each peer's signal arrives (acquire), that peer's share go into the op's
                  fresh output: the ops are functional (nothing they return aliases the workspace, which the
                  next exchange overwrites); the flag goes back to 0

`method = "copies"` (the default, DEFAULT_METHOD says why) does the same with torch copies between two workspace
barriers (handle.barrier: every rank's last copy-out done / every peer's writes landed), then one copy-out: five
launches for R = 2.
LMF_SYMM_EXCHANGE_METHOD chooses at prepare time.

The fragment exchange runs on its own stream (fragment_layouts.start_publish), forked where the shared expert's
output is ready, beside the routed experts whether the shared GEMMs ran on a side stream (decode) or in line
(prefill); the caller's stream joins it before the producer returns. The TP output gather runs on the caller's
stream: the tail, next on that stream, is what waits for it.

Selection is rank-consistent: the workspace exists on every rank or on none (prepare agrees on success and on the
LMF_SYMM_EXCHANGE setting across the group), and the per-call choice depends only on the token count and the
hidden size, which are the same on every rank. Anything else (CPU, gloo, no workspace, too many tokens, the
window) takes the torch.distributed path.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from latent_moe_fusion import envs

from .device_capability import sm_count
from .fragment_layouts import resolve_group
from .measured_tables import load_table

ENV = "LMF_SYMM_EXCHANGE"  # "auto" (default: the measured windows), "on" (wherever the workspace fits), "off"
CHOICES = ("auto", "on", "off")
_CODES = {"off": 0, "auto": 1, "on": 2}  # agreed across ranks by MIN: one rank's "off" turns it off everywhere
# Token windows (the op's output tokens M: TP every rank's M, SP the local tokens) where the symmetric path is
# taken by default, measured on two H200 (bench/tp.py -> bench/results/tp.md). None: no bound.
# Per method: (fragments, gather). The copies' windows from bench/results/tp.md: below 8 tokens
# NCCL's all-to-all and all-gather took ~13 us where the copies between barriers took ~30: measured bounds, kept in
# exchange_thresholds.json beside this file (package data) with their rule and source. The kernel has no measured
# window (it has not run on two GPUs): every size.
EXCHANGE_THRESHOLDS = load_table(Path(__file__).resolve().with_name("exchange_thresholds.json"),
                                 ("copies_fragments_min_tokens", "copies_gather_min_tokens"))
WINDOWS: dict[str, tuple[tuple[int, int | None], tuple[int, int | None]]] = {
    "kernel": ((1, None), (1, None)),
    "copies": ((EXCHANGE_THRESHOLDS.value("copies_fragments_min_tokens"), None),
               (EXCHANGE_THRESHOLDS.value("copies_gather_min_tokens"), None)),
}
# Signal channels of the workspace's signal pad (copy method): fragments and output gather each use their own pair.
_CHANNELS = {"fragments": (0, 1), "gather": (2, 3)}
# The fragments go out beside the routed experts, whose kernels fill the SMs: a few exchange programs leave them
# their slots (each program spins only for its own chunks); the TP output gather gets every SM.
FRAGMENT_PROGRAMS = 32
_KINDS = ("fragments", "gather")
_ALIGN = 256
_MAX_VIEWS = 1024
METHODS = ("kernel", "copies")
METHOD_ENV = "LMF_SYMM_EXCHANGE_METHOD"  # read by prepare_symmetric_exchange; must be the same on every rank
# The copies are the default: they ran on two H200 (tests/test_symm_exchange_gpu.py, bench/results/tp.md). The kernel has run on one GPU only, its ranks as concurrent streams
# (tests/test_peer_exchange_gpu.py): no two-GPU machine was lent after it was written.
DEFAULT_METHOD = "copies"


@dataclass(frozen=True)
class Parts:
    """An exchange's operands: this rank's part p (for rank p) at src + p * part_stride, [rows, cols] with row
    stride src_row_stride; the output's slot r (from rank r) at out + r * slot_stride, row stride out_row_stride."""

    src: torch.Tensor
    part_stride: int
    src_row_stride: int
    out: torch.Tensor
    slot_stride: int
    out_row_stride: int
    rows: int
    cols: int

    def part(self, p: int) -> torch.Tensor:
        return self.src.as_strided((self.rows, self.cols), (self.src_row_stride, 1),
                                   self.src.storage_offset() + p * self.part_stride)

    def slots(self, world: int) -> torch.Tensor:
        """The output as [R, rows, cols] (slot r first), a strided view."""
        return self.out.as_strided((world, self.rows, self.cols), (self.slot_stride, self.out_row_stride, 1),
                                   self.out.storage_offset())


@dataclass
class SymmetricExchange:
    """One group's workspace: [fragment region | output region | flags] of one symmetric allocation on every rank.
    A region holds [R, rows, cols] (slot r: what rank r sent); flags: int32 [2 kinds, 2 R, MAX_PROGRAMS], zero at rest.
    method "kernel": one Triton launch per exchange (peer_exchange.py); "copies": torch copies
    between two workspace barriers (module docstring)."""

    group_name: str
    world: int
    rank: int
    device: torch.device
    max_tokens: int
    hidden: int
    setting: str
    buffer: torch.Tensor
    handle: object
    fragment_bytes: int  # each region also holds the kernel's places for every (source rank, chunk)
    output_bytes: int
    method: str = DEFAULT_METHOD
    max_programs: int = 132  # the gather's grid (it is on the critical path: every SM)
    fragment_programs: int = FRAGMENT_PROGRAMS
    fragment_window: tuple[int, int | None] | None = None  # None: the method's WINDOWS entry
    gather_window: tuple[int, int | None] | None = None
    publishes: int = 0  # calls that took this path (host counts: what a test or benchmark asserts ran)
    gathers: int = 0
    places: dict = field(default_factory=dict)  # kind -> (chunk places per source rank, bytes per place)
    _views: dict = field(default_factory=dict, repr=False)
    _tables: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.places:
            self.places = kernel_places(self.world, self.max_tokens, self.hidden, self.fragment_bytes,
                                        self.output_bytes)

    def _wanted(self, tokens: int, window: tuple[int, int | None] | None, kind: str) -> bool:
        if self.setting == "off" or tokens > self.max_tokens:
            return False
        if self.setting == "on":
            return True
        low, high = window or WINDOWS[self.method][_KINDS.index(kind)]
        return tokens >= low and (high is None or tokens <= high)

    def _region(self, kind: str) -> int:
        return self.fragment_bytes if kind == "fragments" else self.output_bytes

    def _places(self, kind: str, dtype: torch.dtype):
        """The kernel's chunk places in `kind`'s region, counted in elements of dtype."""
        from .peer_exchange import Places

        count, place_bytes = self.places[kind]
        return Places(count, place_bytes // _itemsize(dtype))

    def _fits(self, kind: str, rows: int, cols: int, dtype: torch.dtype) -> bool:
        """Whether an exchange of [rows, cols] parts fits the region: the copies' R slots, the kernel's chunks."""
        from .peer_exchange import Chunks

        if self.method == "copies":
            return self.world * rows * cols * _itemsize(dtype) <= self._region(kind)
        return self._places(kind, dtype).hold(Chunks.of(rows, cols), self._programs(kind))

    def _programs(self, kind: str) -> int:
        """The kernel's grid for `kind`: fixed for the workspace's life (program i owns its flags and places)."""
        return self.fragment_programs if kind == "fragments" else self.max_programs

    def serves_fragments(self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
        if device != self.device or hidden > self.hidden or hidden % self.world:
            return False
        # checked for the SP form's parts [tokens, H], the larger (TP's are [tokens, H/R])
        return self._fits("fragments", tokens, hidden, dtype) and self._wanted(tokens, self.fragment_window, "fragments")

    def serves_gather(self, tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (device == self.device and width * self.world <= self.hidden
                and self._fits("gather", tokens, width, dtype) and self._wanted(tokens, self.gather_window, "gather"))

    def view(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, byte_offset: int = 0) -> torch.Tensor:
        """rank's workspace (this rank's mapping of it) as a contiguous tensor of `shape` at byte_offset."""
        key = (rank, shape, dtype, byte_offset)
        if key not in self._views:
            if len(self._views) >= _MAX_VIEWS:  # a server sees many token counts: keep the cache bounded
                self._views.clear()
            self._views[key] = self.handle.get_buffer(rank, shape, dtype, byte_offset // _itemsize(dtype))
        return self._views[key]

    def _region_offset(self, kind: str) -> int:
        return 0 if kind == "fragments" else self.fragment_bytes

    def _flags_offset(self, kind: str) -> int:
        from .peer_exchange import FLAG_SETS, MAX_PROGRAMS

        return self.fragment_bytes + self.output_bytes + _KINDS.index(kind) * FLAG_SETS * self.world * MAX_PROGRAMS * 4

    def _table(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [R] addresses of every rank's region and flags of `kind`, as this rank maps them."""
        if kind not in self._tables:
            regions = [self.view(r, (1,), torch.uint8, self._region_offset(kind)).data_ptr() for r in range(self.world)]
            flags = [self.view(r, (1,), torch.int32, self._flags_offset(kind)).data_ptr() for r in range(self.world)]
            self._tables[kind] = (torch.tensor(regions, dtype=torch.int64, device=self.device),
                                  torch.tensor(flags, dtype=torch.int64, device=self.device))
        return self._tables[kind]

    def _exchange(self, kind: str, parts: Parts) -> None:
        if self.method == "kernel":
            from .peer_exchange import launch_peer_exchange

            regions, flags = self._table(kind)
            launch_peer_exchange(parts.src, parts.part_stride, parts.src_row_stride, parts.out, parts.slot_stride,
                                 parts.out_row_stride, regions, flags, self._places(kind, parts.out.dtype), self.rank,
                                 self.world, parts.rows, parts.cols, self._programs(kind))
            return
        shape, offset = (self.world, parts.rows, parts.cols), self._region_offset(kind)
        first, second = _CHANNELS[kind]
        self.handle.barrier(channel=first)
        for step in range(self.world):
            owner = (self.rank + step) % self.world
            self.view(owner, shape, parts.src.dtype, offset)[self.rank].copy_(parts.part(owner))
        self.handle.barrier(channel=second)
        parts.slots(self.world).copy_(self.view(self.rank, shape, parts.src.dtype, offset))  # one launch

    def publish(self, s_partial: torch.Tensor, mode: str, out: torch.Tensor) -> torch.Tensor:
        """This rank's partial shared output [M_s, H] into every owner's fragments; `out` (fresh, the op's ws,
        contiguous with the fragment layout's numel) receives this rank's fragments. On the current stream."""
        s_partial = s_partial.contiguous()
        m_s, hidden = s_partial.shape
        world = self.world
        if mode == "hidden_scatter":  # ws [R, M, H/R]: part p = columns p*H/R.. of every token
            width = hidden // world
            ws = out.view(world, m_s, width)
            parts = Parts(s_partial, width, hidden, ws, m_s * width, width, m_s, width)
        else:  # token_publish: ws [M, R, H], part p = tokens p*M .. of the rank-major batch
            m = m_s // world
            ws = out.view(m, world, hidden)
            parts = Parts(s_partial, m * hidden, hidden, ws, hidden, world * hidden, m, hidden)
        self._exchange("fragments", parts)
        self.publishes += 1
        return ws

    def gather_columns(self, out_slice: torch.Tensor) -> torch.Tensor:
        """Every rank's column slice [M, H/R] into a fresh [M, H] (rank-major columns). On the current stream."""
        out_slice = out_slice.contiguous()
        m, width = out_slice.shape
        out = out_slice.new_empty(m, self.world * width)
        self._exchange("gather", Parts(out_slice, 0, width, out, width, self.world * width, m, width))
        self.gathers += 1
        return out


_EXCHANGES: dict[str, SymmetricExchange] = {}


def _kernel_layouts(world: int, max_tokens: int, hidden: int):
    """The kernel's chunk places per kind: fragments up to the SP form's [max_tokens, H] parts (TP's are
    [max_tokens, H/R]), the gather up to [max_tokens, H/R]."""
    from .peer_exchange import Places

    return {"fragments": Places.up_to(max_tokens, hidden), "gather": Places.up_to(max_tokens, hidden // world)}


def flag_bytes(world: int) -> int:
    """Bytes of the kernel's flags on a rank, after the two regions (zero at rest)."""
    from .peer_exchange import FLAG_SETS, MAX_PROGRAMS

    return len(_KINDS) * FLAG_SETS * world * MAX_PROGRAMS * 4


def region_sizes(world: int, max_tokens: int, hidden: int, itemsize: int) -> tuple[int, int]:
    """(fragment, output) region bytes on a rank: room for the copies' [R, rows, cols] slots and for the kernel's
    chunk places (kernel_places), rounded up to _ALIGN."""
    layouts = _kernel_layouts(world, max_tokens, hidden)
    fragments = max(world * max_tokens * hidden * itemsize, layouts["fragments"].region_bytes(world, itemsize))
    output = max(world * max_tokens * (hidden // world) * itemsize, layouts["gather"].region_bytes(world, itemsize))
    return -(-fragments // _ALIGN) * _ALIGN, -(-output // _ALIGN) * _ALIGN


def kernel_places(world: int, max_tokens: int, hidden: int, fragment_bytes: int,
                  output_bytes: int) -> dict[str, tuple[int, int]]:
    """kind -> (places per source rank, bytes per place): each region split evenly over its places (at least the
    prepared dtype's need, more for wider dtypes where the region has room)."""
    layouts = _kernel_layouts(world, max_tokens, hidden)
    regions = {"fragments": fragment_bytes, "gather": output_bytes}
    return {kind: (places.count, regions[kind] // (world * places.count) // 16 * 16)
            for kind, places in layouts.items()}


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _setting() -> str:
    return envs.read(ENV)  # one of CHOICES


def _method() -> str:
    return envs.read(METHOD_ENV)  # one of METHODS, DEFAULT_METHOD when unset


def _agree_min(value: int, group: dist.ProcessGroup, device: torch.device) -> int:
    flag = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return int(flag.item())


def _local_reason(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why this rank cannot take part (None: it can)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"device {device} is not a CUDA device"
    if "nccl" not in str(dist.get_backend(group)).lower():
        return f"group backend {dist.get_backend(group)!r} is not NCCL"
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return "this torch has no torch.distributed._symmetric_memory"
    return None


def prepare_symmetric_exchange(group: dist.ProcessGroup | str | None = None, max_tokens: int = 4096,
                               hidden: int = 7168, dtype: torch.dtype = torch.bfloat16,
                               device: torch.device | str | None = None) -> SymmetricExchange | None:
    """Allocate and rendezvous `group`'s symmetric workspace (collective: every rank of the group calls it, outside
    any forward and outside CUDA-graph capture). max_tokens: the most tokens one op call moves (TP: M on every
    rank, SP: the local tokens); hidden, dtype: the block's hidden size and fragment dtype (larger calls fall back
    to torch.distributed). Returns the exchange, or None where any rank cannot take part or LMF_SYMM_EXCHANGE=off
    on any rank (then every rank keeps the torch.distributed path)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("prepare_symmetric_exchange needs torch.distributed initialised (init_process_group)")
    if group is None or isinstance(group, str):
        group = dist.group.WORLD if group is None else resolve_group(group)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("prepare_symmetric_exchange allocates and rendezvouses: call it before CUDA-graph capture")
    if max_tokens < 1 or hidden < 1:
        raise ValueError(f"max_tokens = {max_tokens} and hidden = {hidden} must be positive")
    from .peer_exchange import MAX_BLOCK_ROWS, MAX_PROGRAMS, Chunks

    if Chunks.of(max_tokens, hidden).block_r > MAX_BLOCK_ROWS:
        raise ValueError(f"max_tokens = {max_tokens} at hidden = {hidden} needs more chunk flags than the workspace "
                         "has: prepare for fewer tokens (larger calls take the torch.distributed path anyway)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    release_symmetric_exchange(group.group_name)
    reason = _local_reason(group, device)
    # The agreement's own collective runs on the group's backend: NCCL takes CUDA tensors, gloo CPU ones.
    nccl = "nccl" in str(dist.get_backend(group)).lower()
    agree_on = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    agreed = _agree_min(-1 if reason is not None else _CODES[_setting()], group, agree_on)
    if world == 1 or agreed <= 0:
        return None
    method = METHODS.index(_method())
    if _agree_min(method, group, agree_on) != -_agree_min(-method, group, agree_on):
        raise ValueError(f"{METHOD_ENV} differs across the ranks of the group: the two methods do not interoperate, "
                         "set the same one everywhere")
    import torch.distributed._symmetric_memory as symm_mem

    itemsize = _itemsize(dtype)
    fragment_bytes, output_bytes = region_sizes(world, max_tokens, hidden, itemsize)
    total = fragment_bytes + output_bytes + flag_bytes(world)
    try:
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        buffer.zero_()  # the flags start at rest; every rank is done before the rendezvous returns anywhere
        torch.cuda.synchronize(device)
        allocated = 1
    except Exception:  # noqa: BLE001 - another rank may have succeeded: agree before the rendezvous
        buffer, allocated = None, 0
    if _agree_min(allocated, group, device) == 0:
        return None
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:  # needed by older torch, deprecated (a no-op) in newer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    # The kernel's grid must be the same on every rank: the fewest SMs of the group's GPUs.
    programs = _agree_min(sm_count(device), group, device)
    exchange = SymmetricExchange(group.group_name, world, rank, device, max_tokens, hidden,
                                 "on" if agreed == _CODES["on"] else "auto", buffer, handle, fragment_bytes,
                                 output_bytes, method=METHODS[method], max_programs=min(programs, MAX_PROGRAMS))
    _EXCHANGES[group.group_name] = exchange
    return exchange


def release_symmetric_exchange(group_name: str | None = None) -> None:
    """Forget group_name's workspace (every group's when None); later calls take the torch.distributed path."""
    if group_name is None:
        _EXCHANGES.clear()
    else:
        _EXCHANGES.pop(group_name, None)


def exchange_for(group_name: str | None) -> SymmetricExchange | None:
    return None if group_name is None else _EXCHANGES.get(group_name)


def fragments_exchange(group_name: str | None, tokens: int, hidden: int, like: torch.Tensor) -> SymmetricExchange | None:
    """The exchange that publishes fragments of `tokens` output tokens, or None (torch.distributed)."""
    exchange = exchange_for(group_name)
    if exchange is None or not exchange.serves_fragments(tokens, hidden, like.dtype, like.device):
        return None
    return exchange


def gather_exchange(group_name: str | None, out_slice: torch.Tensor) -> SymmetricExchange | None:
    """The exchange that all-gathers output column slices like out_slice, or None (torch.distributed)."""
    exchange = exchange_for(group_name)
    if exchange is None or not exchange.serves_gather(out_slice.shape[0], out_slice.shape[1], out_slice.dtype,
                                                      out_slice.device):
        return None
    return exchange
