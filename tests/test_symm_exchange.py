"""The symmetric-memory exchange (ops/symm_exchange.py) on the CPU.

Its index arithmetic runs for real on R threads, one per rank, over an in-process stand-in for the symmetric
workspace (every rank's buffer visible to every thread, the barrier a thread barrier): the published fragments
and the gathered output must be the DESIGN.md layouts of the ranks' data, bitwise, exchange after exchange.
The real path (NCCL, peer-mapped GPU memory) is tests/test_symm_exchange_gpu.py. Here also: the per-call choice,
and prepare_symmetric_exchange failing closed on gloo in real processes (every rank keeps torch.distributed).
"""

from __future__ import annotations

import threading

import pytest
import torch

from latent_moe_fusion.ops import layouts
from latent_moe_fusion.ops.symm_exchange import ENV, SymmetricExchange, _setting, prepare_symmetric_exchange
from tests.gloo import run_gloo

HIDDEN = 64


class ThreadWorkspaces:
    """R ranks' workspaces in one process: get_buffer(r) views rank r's bytes, barrier() waits for all threads."""

    def __init__(self, world: int, nbytes: int) -> None:
        self.buffers = [torch.full((nbytes,), 0xFF, dtype=torch.uint8) for _ in range(world)]  # poison: NaN
        self.meet = threading.Barrier(world, timeout=30)
        self.channels: list[int] = []

    def handle(self, rank: int) -> ThreadHandle:
        return ThreadHandle(self, rank)


class ThreadHandle:
    def __init__(self, spaces: ThreadWorkspaces, rank: int) -> None:
        self.spaces, self.rank = spaces, rank

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        numel = 1
        for size in sizes:
            numel *= size
        return self.spaces.buffers[rank].view(dtype)[storage_offset:storage_offset + numel].view(tuple(sizes))

    def barrier(self, channel: int = 0) -> None:
        if self.rank == 0:
            self.spaces.channels.append(channel)
        self.spaces.meet.wait()


def exchanges(world: int, max_tokens: int, setting: str = "on") -> list[SymmetricExchange]:
    fragment_bytes = world * max_tokens * HIDDEN * 4
    spaces = ThreadWorkspaces(world, fragment_bytes + max_tokens * HIDDEN * 4)
    return [SymmetricExchange("g", world, rank, torch.device("cpu"), max_tokens, HIDDEN, setting,
                              spaces.buffers[rank], spaces.handle(rank), fragment_bytes) for rank in range(world)]


def on_threads(world: int, fn) -> list:
    results: list = [None] * world
    errors: list = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def dense_fragments(partials: list[torch.Tensor], mode: str, owner: int) -> torch.Tensor:
    """DESIGN.md section 2's ws on rank `owner` from every rank's partial shared output."""
    world = len(partials)
    if mode == "hidden_scatter":
        width = partials[0].shape[1] // world
        return torch.stack([p[:, owner * width:(owner + 1) * width] for p in partials])
    m = partials[0].shape[0] // world
    return torch.stack([p[owner * m:(owner + 1) * m] for p in partials], dim=1)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("mode", ["hidden_scatter", "token_publish"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_published_fragments_are_the_layout_bitwise(world, mode, dtype, rng_seed):
    max_tokens = 12
    ranks = exchanges(world, max_tokens)
    for tokens in (max_tokens, 3):  # a second exchange over the first one's bytes: nothing stale survives
        m_s = tokens if mode == "hidden_scatter" else tokens * world
        partials = [torch.randn(m_s, HIDDEN).to(dtype) for _ in range(world)]
        shape = layouts.fragment_shape(mode, tokens, HIDDEN, world)

        def publish(rank: int, partials=partials, shape=shape) -> torch.Tensor:
            out = torch.full(shape, float("nan"), dtype=dtype)
            return ranks[rank].publish(partials[rank], mode, out)

        for owner, ws in enumerate(on_threads(world, publish)):
            assert ws.shape == shape and ws.is_contiguous()
            assert torch.equal(ws, dense_fragments(partials, mode, owner)), (tokens, owner)
    assert [ex.publishes for ex in ranks] == [2] * world


@pytest.mark.parametrize("world", [2, 4])
def test_gathered_columns_are_every_rank_slice_bitwise(world, rng_seed):
    ranks = exchanges(world, 10)
    for tokens in (10, 1):
        slices = [torch.randn(tokens, HIDDEN // world).to(torch.bfloat16) for _ in range(world)]
        outs = on_threads(world, lambda rank, slices=slices: ranks[rank].gather_columns(slices[rank]))
        for out in outs:
            assert torch.equal(out, torch.cat(slices, dim=1))
            # a fresh tensor, not a view of the workspace the next gather overwrites
            assert all(out.untyped_storage().data_ptr() != ex.buffer.untyped_storage().data_ptr() for ex in ranks)


def test_each_exchange_meets_twice_on_its_own_channels():
    ranks = exchanges(2, 4)
    on_threads(2, lambda rank: ranks[rank].publish(torch.randn(4, HIDDEN), "hidden_scatter",
                                                   torch.empty(2, 4, HIDDEN // 2)))
    on_threads(2, lambda rank: ranks[rank].gather_columns(torch.randn(4, HIDDEN // 2)))
    assert ranks[0].handle.spaces.channels == [0, 1, 2, 3]


def test_the_choice_follows_setting_window_and_capacity():
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    auto = exchanges(2, 64, setting="auto")[0]
    auto.fragment_window, auto.gather_window = (4, 32), (1, 8)
    assert [auto.serves_fragments(t, HIDDEN, dtype, cpu) for t in (3, 4, 32, 33)] == [False, True, True, False]
    assert [auto.serves_gather(t, HIDDEN // 2, dtype, cpu) for t in (1, 8, 9)] == [True, True, False]
    on = exchanges(2, 64, setting="on")[0]
    on.fragment_window = (4, 32)
    assert on.serves_fragments(3, HIDDEN, dtype, cpu) and on.serves_fragments(64, HIDDEN, dtype, cpu)
    assert not on.serves_fragments(65, HIDDEN, dtype, cpu), "more tokens than the workspace holds"
    assert not on.serves_fragments(64, HIDDEN, torch.float64, cpu), "8-byte fragments overflow the workspace"
    assert not on.serves_fragments(8, HIDDEN + 2, dtype, cpu), "wider than the workspace's hidden size"
    assert not on.serves_fragments(8, HIDDEN, dtype, torch.device("meta")), "another device than the workspace's"
    on.setting = "off"
    assert not on.serves_fragments(8, HIDDEN, dtype, cpu) and not on.serves_gather(8, HIDDEN // 2, dtype, cpu)


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        _setting()
    monkeypatch.setenv(ENV, " ON ")
    assert _setting() == "on"


def test_prepare_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        prepare_symmetric_exchange(max_tokens=8, hidden=HIDDEN)


def _gloo_worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    exchange = prepare_symmetric_exchange(dist.group.WORLD, max_tokens=8, hidden=HIDDEN, device="cpu")
    gen = torch.Generator().manual_seed(seed + rank)
    s_partial = torch.randn(8, HIDDEN, generator=gen).to(torch.bfloat16)
    ws = layouts.start_publish(s_partial, "hidden_scatter", dist.group.WORLD.group_name).wait()
    every = [torch.empty_like(s_partial) for _ in range(world)]
    dist.all_gather(every, s_partial)
    return {"exchange": exchange, "ws_ok": bool(torch.equal(ws, dense_fragments(every, "hidden_scatter", rank)))}


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_groups_keep_torch_distributed(world, rng_seed):
    for rank, res in enumerate(run_gloo(_gloo_worker, world, (rng_seed,))):
        assert res["exchange"] is None, rank  # every rank agreed: no workspace on a gloo group
        assert res["ws_ok"], rank
