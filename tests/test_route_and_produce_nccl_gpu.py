"""lmf::route_and_produce's CUDA shared-first schedule with R > 1 on real GPUs (NCCL, one process per GPU):
a TP block (16 tokens on every rank, fragments all-reduced by the tail) and an SP block (8 tokens per rank,
fragments published by all-to-all after the shared expert's side stream joins), MXFP4 experts, compiled with
the pass, against eager; the schedule is asserted to have run, and its outputs are bitwise those with it
switched off (the shared_first_schedule override False: the router, the down-projection and the producer in a row)."""

import pytest
import torch

import latent_moe_fusion as lmf
from tests.fusion_models import compiled, kimi_tp_and_sp_on_gpus, rel_l2, tp_and_sp_inputs
from tests.gloo import run_gloo

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BF16_TOL = 1.5e-2


def _nccl_worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    from latent_moe_fusion import tuning
    from latent_moe_fusion.ops.routed import expert_schedule

    dev = torch.device("cuda", rank)
    model = kimi_tp_and_sp_on_gpus(dist.group.WORLD, dev)
    x, x_local, _ = tp_and_sp_inputs(world, rank, seed, dev, model.tp.cfg.hidden_size)  # same draws on every rank
    eager = model(x, x_local)
    fusion_pass = lmf.LatentMoEFusionPass()
    fused_fn = compiled(model, fusion_pass)
    planned, real = [], expert_schedule.planned_grouping

    def counting(*args, **kwargs):  # only the shared-first schedule plans the grouping ahead of run_experts
        planned.append(args[1].shape[0])
        return real(*args, **kwargs)

    expert_schedule.planned_grouping = counting
    try:
        fused = fused_fn(x, x_local)
        torch.cuda.synchronize()
        with tuning.overrides(shared_first_schedule=False):
            in_a_row = fused_fn(x, x_local)
        torch.cuda.synchronize()
    finally:
        expert_schedule.planned_grouping = real
    return {
        "forms": sorted(b.form for b in fusion_pass.report.blocks),
        "with_producer": [r.with_producer for r in fusion_pass.report.routings],
        "planned_tokens": planned,
        "rel": [rel_l2(out.cpu(), ref.cpu()) for out, ref in zip(fused, eager, strict=True)],
        "bitwise_in_a_row": [bool(torch.equal(a, b)) for a, b in zip(fused, in_a_row, strict=True)],
        "finite": all(bool(torch.isfinite(out).all()) for out in fused),
        "tp_out": fused[0].float().sum().item(),
    }


@pytest.mark.parametrize("world", [2, 4])
def test_shared_first_with_fragments_published_across_gpus(world, rng_seed):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    results = run_gloo(_nccl_worker, world, (rng_seed,), timeout=900, backend="nccl")
    for rank, res in enumerate(results):
        assert res["forms"] == ["all_reduce", "sequence_parallel"], (rank, res["forms"])
        assert res["with_producer"] == [True, True], (rank, res["with_producer"])
        assert sorted(res["planned_tokens"]) == [8, 16], (rank, res["planned_tokens"])  # both blocks, once each
        assert res["finite"], rank
        assert max(res["rel"]) <= BF16_TOL, (rank, res["rel"])
        assert all(res["bitwise_in_a_row"]), (rank, res["bitwise_in_a_row"])
    assert len({res["tp_out"] for res in results}) == 1, "TP output differs between ranks"
