"""Shared-fragment layouts (docs/design.md, section 2) and the cross-rank movement that fills them.

On rank q of R:
  local          (R = 1)    ws [1, M, H]
  hidden_scatter (TP)       ws [R, M, H/R],  ws[r]    = s_partial_of_rank_r[:, q*H/R:(q+1)*H/R]
  token_publish  (SP)       ws [M, R, H],    ws[t, r] = s_partial_of_rank_r[q*M + t, :]
Movement here is plain torch.distributed on the named group; it is the reference that the symmetric-memory
path (symm_exchange.py, taken where prepare_symmetric_exchange made a workspace) matches bitwise.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .side_streams import side_stream

MODES = ("local", "hidden_scatter", "token_publish")


def resolve_group(group_name: str | None) -> dist.ProcessGroup | None:
    """The process group registered under `group_name`, or None for a single rank."""
    if group_name is None:
        return None
    # ValueError for both failures: the ops' validation turns it into an LmfInputError naming group_name.
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"group_name={group_name!r} was given but torch.distributed is not initialized: "
            "call torch.distributed.init_process_group first, or pass group_name=None for R = 1"
        )
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except Exception as exc:  # the c10d error does not name the argument
        raise ValueError(
            f"group_name={group_name!r} names no process group; pass group.group_name of a live group"
        ) from exc


def group_size(group_name: str | None) -> int:
    group = resolve_group(group_name)
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group_name: str | None) -> int:
    group = resolve_group(group_name)
    return 0 if group is None else dist.get_rank(group)


def fragment_shape(mode: str, m_out: int, hidden: int, world: int) -> tuple[int, int, int]:
    """Shape of ws on one rank. m_out: tokens of the tail's output on this rank."""
    if mode == "local":
        return (1, m_out, hidden)
    if mode == "hidden_scatter":
        return (world, m_out, hidden // world)
    if mode == "token_publish":
        return (m_out, world, hidden)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


class PendingFragments:
    """A fragment exchange in flight: `wait()` makes the current stream wait for it and returns ws. Its buffers
    belong to the stream that was current when they were made (fragment_buffers), so a caller that makes them on
    its own stream and waits on that stream can launch the exchange from a side stream without record_stream."""

    def __init__(self, recv: torch.Tensor, mode: str, work=None, keep: tuple = (),
                 done: torch.cuda.Event | None = None) -> None:
        self.recv, self.mode, self.work, self.keep, self.done = recv, mode, work, keep, done

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.done is not None:  # symmetric path: it ran on the fragment_exchange stream (_publish_beside)
            torch.cuda.current_stream(self.recv.device).wait_event(self.done)
            self.done = None
            return self.recv  # already in the mode's layout
        self.keep = ()
        return self.recv.transpose(0, 1).contiguous() if self.mode == "token_publish" else self.recv


def _output_tokens(m_s: int, mode: str, world: int) -> int:
    return m_s if mode == "hidden_scatter" else m_s // world


def _symmetric(group_name: str | None, m_s: int, hidden: int, mode: str, world: int, like: torch.Tensor):
    from .symm_exchange import fragments_exchange

    return fragments_exchange(group_name, _output_tokens(m_s, mode, world), hidden, like)


def fragment_buffers(m_s: int, hidden: int, mode: str, world: int, like: torch.Tensor,
                     group_name: str | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(send, recv) of the exchange that publishes fragments, made on the current stream (send None where the
    symmetric-memory path will run: it writes straight into the owners' workspaces)."""
    shape = (world, m_s, hidden // world) if mode == "hidden_scatter" else (world, m_s // world, hidden)
    symmetric = _symmetric(group_name, m_s, hidden, mode, world, like) is not None
    return None if symmetric else like.new_empty(shape), like.new_empty(shape)


def start_publish(s_partial: torch.Tensor, mode: str, group_name: str | None,
                  buffers: tuple[torch.Tensor | None, torch.Tensor] | None = None,
                  symmetric: bool = True) -> PendingFragments:
    """Launch the move of this rank's partial shared output [M_s, H] into the owners' fragment layout on the
    current stream (the collective runs asynchronously: other streams' work goes on beside it); `wait()` on the
    result before reading ws. buffers: fragment_buffers made earlier (default: made now). symmetric=False keeps
    the torch.distributed path even where a symmetric-memory workspace would serve (the reference ops)."""
    world = group_size(group_name)
    if world == 1:
        return PendingFragments(s_partial.unsqueeze(1 if mode == "token_publish" else 0).contiguous(), "local")
    group = resolve_group(group_name)
    m_s, hidden = s_partial.shape
    exchange = _symmetric(group_name, m_s, hidden, mode, world, s_partial) if symmetric else None
    if exchange is not None:
        recv = buffers[1] if buffers is not None else fragment_buffers(m_s, hidden, mode, world, s_partial,
                                                                       group_name)[1]
        if not s_partial.is_cuda:  # a stand-in workspace (the CPU tests): its copies run in line, nothing in flight
            return PendingFragments(exchange.publish(s_partial, mode, recv), "local")
        return _publish_beside(exchange, s_partial, mode, recv)
    send, recv = buffers if buffers is not None else fragment_buffers(m_s, hidden, mode, world, s_partial)
    if send is None:  # made for the symmetric path, which no longer serves (the workspace was released)
        send = recv.new_empty(recv.shape)
    if mode == "hidden_scatter":
        send.copy_(s_partial.view(m_s, world, hidden // world).transpose(0, 1))
    else:  # token_publish: chunk q of the rank-major tokens goes to rank q
        send.copy_(s_partial.view(world, m_s // world, hidden))
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return PendingFragments(recv, mode, work, keep=(send,))


def _publish_beside(exchange, s_partial: torch.Tensor, mode: str, recv: torch.Tensor) -> PendingFragments:
    """The symmetric exchange on its own stream, forked from the caller's: the caller's stream goes on with what
    it queues next (the routed experts, where the shared GEMMs ran in line: prefill) and waits only in wait(),
    as it does for NCCL's asynchronous all-to-all. Its barriers then stall that stream, not the caller's, while
    a peer catches up. The buffers are the caller's stream's, which waits before it reads or frees them."""
    device = s_partial.device
    stream = side_stream(device, "fragment_exchange")
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        ws = exchange.publish(s_partial, mode, recv)
        done = torch.cuda.Event()
        done.record(stream)
    return PendingFragments(ws, mode, done=done)


def publish_fragments(s_partial: torch.Tensor, mode: str, group_name: str | None,
                      symmetric: bool = True) -> torch.Tensor:
    """Move this rank's partial shared output [M_s, H] into the owners' fragment layout."""
    return start_publish(s_partial, mode, group_name, symmetric=symmetric).wait()


def fragments_as_rmn(ws: torch.Tensor, mode: str) -> torch.Tensor:
    """A [R, M, N] view of ws (no copy), the order in which fragments are summed."""
    return ws.transpose(0, 1) if mode == "token_publish" else ws


def gather_columns(out_slice: torch.Tensor, group_name: str | None, symmetric: bool = True) -> torch.Tensor:
    """All-gather column slices [M, H/R] of every rank into [M, H] (rank-major columns); by peer writes where a
    symmetric-memory workspace serves (symmetric=False: always torch.distributed)."""
    world = group_size(group_name)
    if world == 1:
        return out_slice
    if symmetric:
        from .symm_exchange import gather_exchange

        exchange = gather_exchange(group_name, out_slice)
        if exchange is not None:
            return exchange.gather_columns(out_slice)
    group = resolve_group(group_name)
    m, width = out_slice.shape
    gathered = out_slice.new_empty(world * m, width)  # one collective into one buffer, then one copy to [M, H]
    dist.all_gather_into_tensor(gathered, out_slice.contiguous(), group=group)
    return gathered.view(world, m, width).permute(1, 0, 2).reshape(m, world * width)


def rank_tail_operands(
    y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str, group_name: str | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y_n, the w_up rows this rank computes, fragments as [R, M, N]) for the tail's backends.

    hidden_scatter: rank q computes the output columns q*H/R.. (then all-gathers them); the other
    layouts compute every column."""
    if mode == "hidden_scatter":  # only this layout needs the group
        return rank_operands(y_n, w_up, ws, mode, group_size(group_name), group_rank(group_name))
    return rank_operands(y_n, w_up, ws, mode)


def rank_operands(
    y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str, world: int = 1, rank: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rank_tail_operands for rank `rank` of `world` given as numbers (no process group: meta tensors suffice)."""
    if mode == "hidden_scatter":
        cols = w_up.shape[0] // world
        return y_n, w_up[rank * cols : (rank + 1) * cols], ws
    return y_n, w_up, fragments_as_rmn(ws, mode)
