"""prepare_symmetric_exchange is all or nothing across the group: one rank that cannot or will not take the symmetric
workspace leaves every rank on torch.distributed.

R gloo processes play GPUs that could take part: the capability probe answers "can" (except on the rank that
refuses), torch's symmetric-memory allocation hands out CPU buffers, and its rendezvous, which only a group that
agreed may reach, records the call and stops there (a CPU has no peer mappings). A rank refuses in each of the three
ways the function knows: LMF_SYMM_EXCHANGE=off, the probe's reason (not NCCL / CUDA / no symmetric memory), and an
allocation that fails. Every rank must return None without reaching the rendezvous, and a later publication must
take the collective. The control case, where no rank refuses, must reach the rendezvous on every rank, so the check
would see a rank that went ahead alone; mismatched LMF_SYMM_EXCHANGE_METHOD must raise on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.exchange_helpers import dense_fragments
from tests.gloo import run_gloo

HIDDEN = 64


class _Rendezvous(Exception):
    """Raised by the stand-in rendezvous: this rank went past every agreement."""


def _prepare_with(rank: int, case: str, refusing: int) -> dict:
    """prepare_symmetric_exchange on this rank with the capability probe, allocation and rendezvous stood in for,
    `refusing` refusing in the way `case` names. What the rank returned and which steps it reached."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from latent_moe_fusion.ops.common import symm_exchange

    steps: list[str] = []

    def probe(group, device):
        return "stand-in: this rank has no NCCL" if case == "probe" and rank == refusing else None

    def empty(*size, dtype, device):
        steps.append("allocated")
        if case == "allocation" and rank == refusing:
            raise RuntimeError("stand-in: out of symmetric memory")
        return torch.empty(*size, dtype=dtype)

    def rendezvous(buffer, group_name):
        steps.append("rendezvous")
        raise _Rendezvous

    env = {symm_exchange.ENV: "off" if case == "setting" and rank == refusing else "auto",
           symm_exchange.METHOD_ENV: "kernel" if case == "method" and rank == refusing else "copies"}
    saved = {"probe": symm_exchange._local_reason, "empty": symm_mem.empty, "rendezvous": symm_mem.rendezvous,
             "enable": getattr(symm_mem, "enable_symm_mem_for_group", None), "sync": torch.cuda.synchronize,
             "env": {name: os.environ.get(name) for name in env}}
    symm_exchange._local_reason, symm_mem.empty, symm_mem.rendezvous = probe, empty, rendezvous
    symm_mem.enable_symm_mem_for_group = lambda group_name: None
    torch.cuda.synchronize = lambda device=None: None
    os.environ.update(env)
    try:
        exchange = symm_exchange.prepare_symmetric_exchange(dist.group.WORLD, max_tokens=8, hidden=HIDDEN,
                                                            device="cpu")
        outcome = "none" if exchange is None else "exchange"
    except _Rendezvous:
        outcome = "rendezvous"
    except ValueError as exc:
        outcome = f"ValueError: {exc}"
    finally:
        symm_exchange._local_reason, symm_mem.empty = saved["probe"], saved["empty"]
        symm_mem.rendezvous, torch.cuda.synchronize = saved["rendezvous"], saved["sync"]
        if saved["enable"] is not None:
            symm_mem.enable_symm_mem_for_group = saved["enable"]
        for name, value in saved["env"].items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return {"outcome": outcome, "steps": steps,
            "registered": symm_exchange.exchange_for(dist.group.WORLD.group_name) is not None}


def _collective_publication(rank: int, world: int, seed: int) -> dict:
    """One TP fragment publication after the refusals: which path moved it, and whether ws is the layout."""
    import torch.distributed as dist

    from latent_moe_fusion.ops.common import fragment_layouts as layouts

    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kwargs):
        calls.append("all_to_all_single")
        return real(*args, **kwargs)

    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(8, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(world)]
    dist.all_to_all_single = counting
    try:
        ws = layouts.start_publish(partials[rank], "hidden_scatter", dist.group.WORLD.group_name).wait()
    finally:
        dist.all_to_all_single = real
    return {"collectives": calls, "layout": bool(torch.equal(ws, dense_fragments(partials, "hidden_scatter", rank)))}


CASES = (("setting", 1), ("probe", -1), ("allocation", 0), ("none", None), ("method", 1))


def _worker(rank: int, world: int, seed: int) -> dict:
    results = {}
    for case, refusing in CASES:
        results[case] = _prepare_with(rank, case, world - 1 if refusing == -1 else refusing)
    results["publication"] = _collective_publication(rank, world, seed)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_one_refusing_rank_keeps_every_rank_on_torch_distributed(world, rng_seed):
    per_rank = run_gloo(_worker, world, (rng_seed,), timeout=180, preload=("latent_moe_fusion",))
    for rank, res in enumerate(per_rank):
        for case in ("setting", "probe", "allocation"):
            got = res[case]
            assert got["outcome"] == "none", (case, rank, got)
            assert "rendezvous" not in got["steps"], (case, rank, got)  # no rank went ahead alone
            assert not got["registered"], (case, rank, got)
        # Setting and probe are agreed before anything is allocated; a failed allocation after every rank tried.
        assert res["setting"]["steps"] == [] and res["probe"]["steps"] == [], (rank, res)
        assert res["allocation"]["steps"] == ["allocated"], (rank, res["allocation"])
        assert res["none"]["outcome"] == "rendezvous", (rank, res["none"])  # the control: agreed, went ahead
        assert res["method"]["outcome"].startswith("ValueError") and "LMF_SYMM_EXCHANGE_METHOD" in res["method"]["outcome"], \
            (rank, res["method"])
        assert res["publication"] == {"collectives": ["all_to_all_single"], "layout": True}, (rank, res["publication"])
