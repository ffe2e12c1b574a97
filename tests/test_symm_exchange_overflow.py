"""A call with more tokens than the symmetric workspace was prepared for takes the torch.distributed path.

R gloo processes share a stand-in workspace (shared-memory CPU buffers, tests/exchange_helpers.py) registered for
the real group, prepared for MAX_TOKENS. The fused ops' movement functions (fragment_layouts.start_publish for the
TP and SP fragments, gather_columns for the TP output) run at MAX_TOKENS, which the workspace serves, and at one
token more, which it must not: which path ran is read from the exchange's own counts and from counting the
torch.distributed collectives, and both paths must deliver docs/design.md's layouts bitwise. The same on GPUs, through
the compiled block: tests/test_tp_sp_graphs_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.exchange_helpers import cpu_exchange, dense_fragments, shared_cpu_buffers
from tests.gloo import run_gloo

HIDDEN = 64
MAX_TOKENS = 8


def _counting(calls: list[str], name: str):
    import torch.distributed as dist

    real = getattr(dist, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    return real, counted


def _worker(rank: int, world: int, buffers: list[torch.Tensor], seed: int) -> list[dict]:
    import torch.distributed as dist

    from latent_moe_fusion.ops.common import fragment_layouts as layouts
    from latent_moe_fusion.ops.common import symm_exchange

    name = dist.group.WORLD.group_name
    exchange = cpu_exchange(rank, buffers, MAX_TOKENS, HIDDEN, dist.barrier, group_name=name, setting="auto")
    symm_exchange._EXCHANGES[name] = exchange  # what prepare_symmetric_exchange registers on a GPU group
    calls: list[str] = []
    patched = {fn: _counting(calls, fn) for fn in ("all_to_all_single", "all_gather_into_tensor")}
    gen = torch.Generator().manual_seed(seed)  # the same draws on every rank: each knows what the others send
    rows = []
    try:
        for fn, (_, counted) in patched.items():
            setattr(dist, fn, counted)
        for tokens in (MAX_TOKENS, MAX_TOKENS + 1, MAX_TOKENS):  # back under the bound after going over it
            for mode in ("hidden_scatter", "token_publish"):
                m_s = tokens if mode == "hidden_scatter" else tokens * world
                partials = [torch.randn(m_s, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(world)]
                before, calls[:] = exchange.publishes, []
                send, _ = layouts.fragment_buffers(m_s, HIDDEN, mode, world, partials[rank], name)
                ws = layouts.start_publish(partials[rank], mode, name).wait()
                rows.append({"what": f"{mode} fragments", "tokens": tokens, "symmetric": exchange.publishes - before,
                             "collectives": list(calls), "send_buffer": send is not None,
                             "layout": bool(torch.equal(ws, dense_fragments(partials, mode, rank)))})
            slices = [torch.randn(tokens, HIDDEN // world, generator=gen).to(torch.bfloat16) for _ in range(world)]
            before, calls[:] = exchange.gathers, []
            out = layouts.gather_columns(slices[rank], name)
            rows.append({"what": "TP output gather", "tokens": tokens, "symmetric": exchange.gathers - before,
                         "collectives": list(calls), "layout": bool(torch.equal(out, torch.cat(slices, dim=1)))})
    finally:
        for fn, (real, _) in patched.items():
            setattr(dist, fn, real)
        symm_exchange.release_symmetric_exchange(name)
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_more_tokens_than_max_tokens_take_the_collective(world, rng_seed):
    buffers = shared_cpu_buffers(world, MAX_TOKENS, HIDDEN)
    per_rank = run_gloo(_worker, world, (buffers, rng_seed), timeout=300, preload=("latent_moe_fusion",))
    for rank, rows in enumerate(per_rank):
        assert len(rows) == 9, rows
        for row in rows:
            assert row["layout"], (rank, row)
            collective = "all_gather_into_tensor" if row["what"] == "TP output gather" else "all_to_all_single"
            if row["tokens"] > MAX_TOKENS:
                assert row["symmetric"] == 0 and row["collectives"] == [collective], (rank, row)
                assert row.get("send_buffer", True), (rank, row)  # the collective needs its send buffer
            else:
                assert row["symmetric"] == 1 and row["collectives"] == [], (rank, row)
                assert not row.get("send_buffer", False), (rank, row)  # peer writes go straight to the owners
