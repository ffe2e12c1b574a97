"""The fused TP and SP blocks over symmetric memory on R GPUs of one host (NCCL, one process per GPU), as serving
runs them: each compiled with the pass and captured in a CUDA graph, then

- 100 replays on fresh inputs (host syncs forbidden), each against eager within BF16 tolerance, the exchange's
  host code run at capture only, memory stable;
- bitwise run to run: the same input replayed again after other inputs, and called again outside the graph,
  gives the same bits; the TP output is bitwise the same on every rank;
- a call with more tokens than prepare_symmetric_exchange's max_tokens takes torch.distributed (the exchange's
  counts do not move) and gives the bits of the same compile with the exchange switched off.

The decision logic of the last point and of the all-or-nothing workspace also runs on the CPU
(tests/test_symm_exchange_overflow.py, tests/test_symm_exchange_agreement.py).
"""

import pytest
import torch

import latent_moe_fusion as lmf
from tests.fusion_models import compiled, kimi_tp_and_sp_on_gpus, rel_l2
from tests.gloo import run_gloo

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BF16_TOL = 1.5e-2
REPLAYS = 100
TP_TOKENS, SP_LOCAL_TOKENS, MAX_TOKENS = 16, 8, 16


def _draw(gen: torch.Generator, world: int, rank: int, form: str, hidden: int, dev: torch.device) -> torch.Tensor:
    """TP: the same tokens on every rank; SP: this rank's block of one batch drawn alike on every rank."""
    if form == "TP":
        return torch.randn(TP_TOKENS, hidden, generator=gen).to(dev, torch.bfloat16)
    return torch.randn(world, SP_LOCAL_TOKENS, hidden, generator=gen)[rank].to(dev, torch.bfloat16)


def _graph_checks(block, form: str, exchange, world: int, rank: int, seed: int) -> dict:
    import torch.distributed as dist

    from tests.graph_replay import replay_without_host_sync

    dev, hidden = torch.device("cuda", rank), block.cfg.hidden_size
    gen = torch.Generator().manual_seed(seed + (0 if form == "TP" else 1))
    fn = compiled(block, lmf.LatentMoEFusionPass())
    first = _draw(gen, world, rank, form, hidden, dev)
    static_x = first.clone()
    direct = [fn(first).clone() for _ in range(2)]  # compiles; twice: run to run outside the graph
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    publishes = exchange.publishes
    with torch.cuda.graph(graph):
        static_out = fn(static_x)
    torch.cuda.synchronize()
    counts = (exchange.publishes, exchange.gathers)
    captured_symmetric = counts[0] - publishes == 1  # the graph holds the peer writes, not a collective
    mem_before, worst = torch.cuda.memory_allocated(dev), 0.0
    for _ in range(REPLAYS):
        fresh = _draw(gen, world, rank, form, hidden, dev)
        static_x.copy_(fresh)
        dist.barrier()
        replay_without_host_sync(graph)
        worst = max(worst, rel_l2(static_out, block(fresh)))
    del fresh
    torch.cuda.synchronize()
    memory_stable = torch.cuda.memory_allocated(dev) == mem_before
    replayed = []
    for x in (first, _draw(gen, world, rank, form, hidden, dev), first):  # the same input around another one
        static_x.copy_(x)
        dist.barrier()
        replay_without_host_sync(graph)
        replayed.append(static_out.clone())
    torch.cuda.synchronize()
    res = {"worst": worst, "memory_stable": memory_stable,
           "host_code_at_capture_only": (exchange.publishes, exchange.gathers) == counts,
           "captured_symmetric": captured_symmetric,
           "bitwise_replays": bool(torch.equal(replayed[0], replayed[2])),
           "bitwise_calls": bool(torch.equal(direct[0], direct[1]))}
    if form == "TP":
        every = [torch.empty_like(replayed[0]) for _ in range(world)]
        dist.all_gather(every, replayed[0])
        res["same_on_every_rank"] = all(torch.equal(out, replayed[0]) for out in every)
    return res


def _overflow_checks(block, exchange, rank: int, seed: int) -> dict:
    """The TP block at MAX_TOKENS (served) and at twice that (more than the workspace was prepared for)."""
    dev, hidden = torch.device("cuda", rank), block.cfg.hidden_size
    gen = torch.Generator().manual_seed(seed + 2)
    fn = compiled(block, lmf.LatentMoEFusionPass())
    res = {}
    for tokens in (MAX_TOKENS, 2 * MAX_TOKENS):
        x = torch.randn(tokens, hidden, generator=gen).to(dev, torch.bfloat16)
        fn(x)  # compile outside the counts
        before = (exchange.publishes, exchange.gathers)
        out = fn(x)
        after = (exchange.publishes, exchange.gathers)
        exchange.setting = "off"
        by_collectives = fn(x)
        exchange.setting = "on"
        torch.cuda.synchronize()
        res[tokens] = {"publishes": after[0] - before[0], "gathers": after[1] - before[1],
                       "bitwise_vs_collectives": bool(torch.equal(out, by_collectives))}
    return res


def _worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    model = kimi_tp_and_sp_on_gpus(dist.group.WORLD, dev)
    exchange = lmf.prepare_symmetric_exchange(dist.group.WORLD, max_tokens=MAX_TOKENS, hidden=model.tp.cfg.hidden_size)
    assert exchange is not None, "no workspace on an NCCL group of GPUs"
    exchange.setting = "on"  # every size up to max_tokens, whatever the measured windows
    try:
        return {"TP": _graph_checks(model.tp, "TP", exchange, world, rank, seed),
                "SP": _graph_checks(model.sp, "SP", exchange, world, rank, seed),
                "overflow": _overflow_checks(model.tp, exchange, rank, seed)}
    finally:
        lmf.release_symmetric_exchange(dist.group.WORLD.group_name)


@pytest.mark.parametrize("world", [2, 4])
def test_fused_tp_and_sp_blocks_in_cuda_graphs(world, rng_seed):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    for rank, res in enumerate(run_gloo(_worker, world, (rng_seed,), timeout=1800, backend="nccl")):
        for form in ("TP", "SP"):
            got = res[form]
            assert got["captured_symmetric"], (rank, form, got)
            assert got["worst"] <= BF16_TOL, (rank, form, got)
            assert got["memory_stable"] and got["host_code_at_capture_only"], (rank, form, got)
            assert got["bitwise_replays"] and got["bitwise_calls"], (rank, form, got)
        assert res["TP"]["same_on_every_rank"], (rank, res["TP"])
        served, over = res["overflow"][MAX_TOKENS], res["overflow"][2 * MAX_TOKENS]
        assert (served["publishes"], served["gathers"]) == (1, 1), (rank, served)
        assert (over["publishes"], over["gathers"]) == (0, 0), (rank, over)  # torch.distributed moved them
        assert served["bitwise_vs_collectives"] and over["bitwise_vs_collectives"], (rank, res["overflow"])
