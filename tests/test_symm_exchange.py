"""The symmetric-memory exchange (ops/common/symm_exchange.py) on the CPU.

Both methods (the one-launch Triton exchange, run by the interpreter, and the torch copies between barriers) run
for real in R processes over a stand-in for the symmetric workspace: every rank's buffer is shared memory that
every process maps (at its own addresses, as peers' GPU buffers are mapped), the copies' barrier a gloo barrier.
The published fragments and the gathered output must be docs/design.md's layouts of the ranks' data, bitwise,
exchange after exchange over the same workspace (the flags must come back to rest). The real path (NCCL,
peer-mapped GPU memory) is tests/test_symm_exchange_gpu.py. Here also: the per-call choice, and
prepare_symmetric_exchange failing closed on gloo (every rank keeps torch.distributed).
"""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common import fragment_layouts as layouts
from latent_moe_fusion.ops.common.symm_exchange import (
    ENV,
    METHOD_ENV,
    WINDOWS,
    SymmetricExchange,
    _method,
    _setting,
    prepare_symmetric_exchange,
)
from tests.exchange_helpers import cpu_exchange, dense_fragments, shared_cpu_buffers, workspace_sizes
from tests.gloo import run_gloo

HIDDEN = 64


def sizes(world: int, max_tokens: int) -> tuple[int, int, int]:
    return workspace_sizes(world, max_tokens, HIDDEN)


def exchange_on(rank: int, buffers: list[torch.Tensor], max_tokens: int, setting: str = "on",
                method: str = "copies") -> SymmetricExchange:
    return cpu_exchange(rank, buffers, max_tokens, HIDDEN, _gloo_barrier, setting=setting, method=method)


def _gloo_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


MAX_TOKENS = 12


def _exchange_worker(rank: int, world: int, buffers: list[torch.Tensor], seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank: each knows what the others send
    failures, channels = [], {}
    for method in ("kernel", "copies"):
        exchange = exchange_on(rank, buffers, MAX_TOKENS, method=method)
        for mode in ("hidden_scatter", "token_publish"):
            for dtype in (torch.bfloat16, torch.float32):
                for tokens in (MAX_TOKENS, 3, 1):  # over the last exchange's bytes: nothing stale may survive
                    m_s = tokens if mode == "hidden_scatter" else tokens * world
                    partials = [torch.randn(m_s, HIDDEN, generator=gen).to(dtype) for _ in range(world)]
                    shape = layouts.fragment_shape(mode, tokens, HIDDEN, world)
                    ws = exchange.publish(partials[rank], mode, torch.full(shape, float("nan"), dtype=dtype))
                    if not (ws.shape == shape and torch.equal(ws, dense_fragments(partials, mode, rank))):
                        failures.append((method, mode, str(dtype), tokens))
        for tokens in (10, 1):
            slices = [torch.randn(tokens, HIDDEN // world, generator=gen).to(torch.bfloat16) for _ in range(world)]
            out = exchange.gather_columns(slices[rank])
            if not torch.equal(out, torch.cat(slices, dim=1)):
                failures.append((method, "gather", tokens))
            if out.untyped_storage().data_ptr() == buffers[rank].untyped_storage().data_ptr():
                failures.append((method, "gather returned the workspace", tokens))
        channels[method] = list(exchange.handle.channels)
        torch.distributed.barrier()  # peers clear this rank's busy flags after their last copy-out
        flags = buffers[rank][exchange.fragment_bytes + exchange.output_bytes:].view(torch.int32)
        if method == "kernel" and bool(flags.any()):
            failures.append((method, "flags not at rest"))
    return {"failures": failures, "channels": channels}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_exchanges_deliver_the_layouts_bitwise(world, rng_seed):
    buffers = shared_cpu_buffers(world, MAX_TOKENS, HIDDEN)
    for rank, res in enumerate(run_gloo(_exchange_worker, world, (buffers, rng_seed), timeout=600,
                                        preload=("latent_moe_fusion",))):
        assert res["failures"] == [], (rank, res["failures"])
        assert res["channels"]["kernel"] == [], "the kernel method signals per program, without workspace barriers"
        assert res["channels"]["copies"] == [0, 1] * 12 + [2, 3] * 2, "two barriers per exchange, per kind"


def test_the_choice_follows_setting_window_and_capacity():
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    buffers = [torch.zeros(sizes(2, 64)[2], dtype=torch.uint8) for _ in range(2)]
    auto = exchange_on(0, buffers, 64, setting="auto")
    auto.fragment_window, auto.gather_window = (4, 32), (1, 8)
    assert [auto.serves_fragments(t, HIDDEN, dtype, cpu) for t in (3, 4, 32, 33)] == [False, True, True, False]
    assert [auto.serves_gather(t, HIDDEN // 2, dtype, cpu) for t in (1, 8, 9)] == [True, True, False]
    on = exchange_on(0, buffers, 64, setting="on")
    on.fragment_window = (4, 32)
    assert on.serves_fragments(3, HIDDEN, dtype, cpu) and on.serves_fragments(64, HIDDEN, dtype, cpu)
    assert not on.serves_fragments(65, HIDDEN, dtype, cpu), "more tokens than the workspace holds"
    on.method = "kernel"
    assert not on.serves_fragments(64, HIDDEN, torch.float64, cpu), "8-byte chunks overflow the kernel's places"
    on.method = "copies"
    assert not on.serves_fragments(8, HIDDEN + 2, dtype, cpu), "wider than the workspace's hidden size"
    assert not on.serves_fragments(8, HIDDEN, dtype, torch.device("meta")), "another device than the workspace's"
    on.setting = "off"
    assert not on.serves_fragments(8, HIDDEN, dtype, cpu) and not on.serves_gather(8, HIDDEN // 2, dtype, cpu)
    auto.fragment_window = auto.gather_window = None  # the method's measured windows
    for method, (fragments, gather) in WINDOWS.items():
        auto.method = method
        assert auto.serves_fragments(fragments[0], HIDDEN, dtype, cpu) and auto.serves_gather(gather[0], 8, dtype, cpu)
        if fragments[0] > 1:
            assert not auto.serves_fragments(fragments[0] - 1, HIDDEN, dtype, cpu)


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        _setting()
    monkeypatch.setenv(ENV, " ON ")
    assert _setting() == "on"
    monkeypatch.setenv(METHOD_ENV, "nvshmem")
    with pytest.raises(ValueError, match=METHOD_ENV):
        _method()
    monkeypatch.setenv(METHOD_ENV, "Copies")
    assert _method() == "copies"


def test_prepare_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        prepare_symmetric_exchange(max_tokens=8, hidden=HIDDEN)


def _gloo_worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    errors = []
    for kwargs in ({"max_tokens": 0}, {"hidden": -1}, {"max_tokens": 1 << 20}):
        try:
            prepare_symmetric_exchange(dist.group.WORLD, device="cpu", **{"max_tokens": 8, "hidden": HIDDEN, **kwargs})
        except ValueError as exc:
            errors.append(str(exc))
    exchange = prepare_symmetric_exchange(dist.group.WORLD, max_tokens=8, hidden=HIDDEN, device="cpu")
    gen = torch.Generator().manual_seed(seed + rank)
    s_partial = torch.randn(8, HIDDEN, generator=gen).to(torch.bfloat16)
    ws = layouts.start_publish(s_partial, "hidden_scatter", dist.group.WORLD.group_name).wait()
    every = [torch.empty_like(s_partial) for _ in range(world)]
    dist.all_gather(every, s_partial)
    return {"exchange": exchange, "errors": errors,
            "ws_ok": bool(torch.equal(ws, dense_fragments(every, "hidden_scatter", rank)))}


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_groups_keep_torch_distributed(world, rng_seed):
    for rank, res in enumerate(run_gloo(_gloo_worker, world, (rng_seed,))):
        assert res["exchange"] is None, rank  # every rank agreed: no workspace on a gloo group
        assert res["ws_ok"], rank
        assert len(res["errors"]) == 3, res["errors"]
        assert "must be positive" in res["errors"][0] and "must be positive" in res["errors"][1]
        assert "prepare for fewer tokens" in res["errors"][2]
