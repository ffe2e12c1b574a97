"""Symmetric-memory fragment publication and output all-gather for R > 1 on CUDA (DESIGN.md section 2:
"symmetric-memory peer writes where available"). layouts.py's torch.distributed movement is the reference; these
paths move the same bytes to the same places, so the ops' outputs are bitwise those of the reference path.

    lmf.prepare_symmetric_exchange(group, max_tokens=4096, hidden=7168)   # collective, once, before capture

allocates one symmetric workspace per group (`torch.distributed._symmetric_memory`: every rank maps every peer's
buffer; unicast stores only, NVLink multicast is never used) and rendezvouses it. From then on, where the token
count lies in the measured window (`SymmetricExchange.fragment_window`, `.gather_window`), the producers publish
their shared fragments by peer writes into the owners' workspaces and the hidden_scatter tail gathers its output
column slices the same way. One exchange on rank q, on the stream that made the data:

    barrier (channel a)   every rank has finished its last read of its own workspace (they are stream-ordered
                          before this barrier on every rank), so it may be overwritten
    peer writes           owner p's workspace receives q's part for p (p = q: a local copy)
    barrier (channel b)   the signal: every peer's writes into q's workspace have landed (release / acquire at
                          system scope; the writes precede the signal in stream order)
    copy out              the op's own fresh output from q's workspace: the ops are functional (nothing they
                          return aliases the workspace, which the next exchange overwrites)

The producer runs its exchange on the shared expert's side stream, beside the routed experts, and the caller's
stream joins it before the producer returns: the tail, next on that stream, is what waits for the signal.

Selection is rank-consistent: the workspace exists on every rank or on none (prepare agrees on success and on the
LMF_SYMM_EXCHANGE setting across the group), and the per-call choice depends only on the token count and the
hidden size, which are the same on every rank. Anything else (CPU, gloo, no workspace, too many tokens, the
window) takes the torch.distributed path.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .layouts import resolve_group

ENV = "LMF_SYMM_EXCHANGE"  # "auto" (default: the measured windows), "on" (wherever the workspace fits), "off"
CHOICES = ("auto", "on", "off")
_CODES = {"off": 0, "auto": 1, "on": 2}  # agreed across ranks by MIN: one rank's "off" turns it off everywhere
# Token windows (the op's output tokens M: TP every rank's M, SP the local tokens) where the symmetric path is
# taken by default, measured on two H200 (bench/tp.py -> bench/results/tp.md). None: no bound.
FRAGMENT_WINDOW: tuple[int, int | None] = (1, None)
GATHER_WINDOW: tuple[int, int | None] = (1, None)
# Signal channels of the workspace's signal pad: fragments and output gather each use their own pair.
_FRAGMENT_CHANNELS, _GATHER_CHANNELS = (0, 1), (2, 3)
_ALIGN = 256


@dataclass
class SymmetricExchange:
    """One group's workspace: [fragment region | output region] of one symmetric allocation on every rank."""

    group_name: str
    world: int
    rank: int
    device: torch.device
    max_tokens: int
    hidden: int
    setting: str
    buffer: torch.Tensor
    handle: object
    fragment_bytes: int
    fragment_window: tuple[int, int | None] = FRAGMENT_WINDOW
    gather_window: tuple[int, int | None] = GATHER_WINDOW
    publishes: int = 0  # calls that took this path (host counts: what a test or benchmark asserts ran)
    gathers: int = 0
    _views: dict = field(default_factory=dict, repr=False)

    def _wanted(self, tokens: int, window: tuple[int, int | None]) -> bool:
        if self.setting == "off" or tokens > self.max_tokens:
            return False
        if self.setting == "on":
            return True
        low, high = window
        return tokens >= low and (high is None or tokens <= high)

    def serves_fragments(self, tokens: int, hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (device == self.device and hidden <= self.hidden and hidden % self.world == 0
                and self.world * tokens * hidden * _itemsize(dtype) <= self.fragment_bytes
                and self._wanted(tokens, self.fragment_window))

    def serves_gather(self, tokens: int, width: int, dtype: torch.dtype, device: torch.device) -> bool:
        output_bytes = self.buffer.numel() - self.fragment_bytes
        return (device == self.device and tokens * width * self.world * _itemsize(dtype) <= output_bytes
                and self._wanted(tokens, self.gather_window))

    def view(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, byte_offset: int = 0) -> torch.Tensor:
        """rank's workspace (this rank's mapping of it) as a contiguous tensor of `shape` at byte_offset."""
        key = (rank, shape, dtype, byte_offset)
        if key not in self._views:
            self._views[key] = self.handle.get_buffer(rank, shape, dtype, byte_offset // _itemsize(dtype))
        return self._views[key]

    def publish(self, s_partial: torch.Tensor, mode: str, out: torch.Tensor) -> torch.Tensor:
        """This rank's partial shared output [M_s, H] into every owner's fragments; `out` (fresh, the op's ws,
        contiguous with the fragment layout's numel) receives this rank's fragments. On the current stream."""
        m_s, hidden = s_partial.shape
        world, me = self.world, self.rank
        if mode == "hidden_scatter":
            shape, width = (world, m_s, hidden // world), hidden // world
        else:  # token_publish: ws [M, R, H], rank p owns tokens p*M .. of the rank-major batch
            shape, width = (m_s // world, world, hidden), m_s // world
        first, second = _FRAGMENT_CHANNELS
        self.handle.barrier(channel=first)
        for step in range(world):
            owner = (me + step) % world
            dst = self.view(owner, shape, s_partial.dtype)
            if mode == "hidden_scatter":
                dst[me].copy_(s_partial[:, owner * width:(owner + 1) * width])
            else:
                dst[:, me].copy_(s_partial[owner * width:(owner + 1) * width])
        self.handle.barrier(channel=second)
        mine = self.view(me, shape, s_partial.dtype)
        ws = out.view(shape)
        ws.copy_(mine)
        self.publishes += 1
        return ws

    def gather_columns(self, out_slice: torch.Tensor) -> torch.Tensor:
        """Every rank's column slice [M, H/R] into a fresh [M, H] (rank-major columns). On the current stream."""
        m, width = out_slice.shape
        world, me = self.world, self.rank
        shape = (m, world * width)
        first, second = _GATHER_CHANNELS
        self.handle.barrier(channel=first)
        for step in range(world):
            owner = (me + step) % world
            self.view(owner, shape, out_slice.dtype, self.fragment_bytes)[:, me * width:(me + 1) * width].copy_(
                out_slice)
        self.handle.barrier(channel=second)
        self.gathers += 1
        return self.view(me, shape, out_slice.dtype, self.fragment_bytes).clone()


_EXCHANGES: dict[str, SymmetricExchange] = {}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _setting() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected one of {CHOICES}")
    return value


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
    import torch.distributed._symmetric_memory as symm_mem

    itemsize = _itemsize(dtype)
    fragment_bytes = -(-world * max_tokens * hidden * itemsize // _ALIGN) * _ALIGN
    output_bytes = max_tokens * hidden * itemsize
    try:
        buffer = symm_mem.empty(fragment_bytes + output_bytes, dtype=torch.uint8, device=device)
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
    exchange = SymmetricExchange(group.group_name, world, rank, device, max_tokens, hidden,
                                 "on" if agreed == _CODES["on"] else "auto", buffer, handle, fragment_bytes)
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
