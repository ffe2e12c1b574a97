"""lmf::route_gather_and_produce on 2 and 4 GPUs (NCCL, one process per GPU): the tokens' gather runs on the shared
expert's stream, beside the down-projection, and the outputs are bitwise lmf::route_and_produce's on the gathered
tokens; compiled, the SP block with the gather inside the op is bitwise today's rewrite (the gather before
lmf::route_and_produce).

Placement: the last rank joins the gather 0.5 s late, so on every other rank the gather cannot finish before then.
Events recorded after the down-projection (on the stream it ran on) and after the gather's wait (on the stream the
op gathered on) show the down-projection done while the gather is still pending: no stream of the down-projection
waited for the gather. A watcher thread polls the events while the op's host side runs, so a host sync later in the
op (none is expected; the id check is switched off) would not hide the order. Checked at 8 tokens a rank (the
shared-first schedule) and 256 (in a row: router and down-projection on the caller's stream, the gather beside).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import latent_moe_fusion as lmf
from tests.fusion_models import ALL_GATHER, ROUTE_GATHER_AND_PRODUCE, compiled, rel_l2
from tests.gloo import run_gloo

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LATE_S = 0.5
TOKENS = (8, 256)


def _sp_block(group, dev: torch.device) -> lmf.KimiK3MoEBlock:
    """Kimi K3 widths with 64 MXFP4 experts and a 768-wide shared expert, router GEMM bf16 (as the TP/SP GPU tests)."""
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    return lmf.KimiK3MoEBlock(cfg, tp_group=group, sequence_parallel=True, weight_format="mxfp4",
                              dtype=torch.bfloat16, device=dev, router_gemm="bf16", seed=2)


class _Spy:
    """Events after each down-projection and after each token gather, and the streams the gathers ran on."""

    def __init__(self) -> None:
        from latent_moe_fusion.ops.routed.router_fused import route_and_produce as produce
        from latent_moe_fusion.ops.routed.router_fused import route_and_project as project
        from latent_moe_fusion.ops.routed.router_fused import route_gather_and_produce as gather

        self.modules = (produce, project, gather)
        self.real_down, self.real_gather = produce.project_down, gather.start_token_gather
        self.down: list[torch.cuda.Event] = []
        self.gathered: list[torch.cuda.Event] = []
        self.gather_streams: list[torch.cuda.Stream] = []

    def _down(self, *args):
        out = self.real_down(*args)
        event = torch.cuda.Event()
        event.record()  # on the stream the down-projection ran on
        self.down.append(event)
        return out

    def _gather(self, *args):
        self.gather_streams.append(torch.cuda.current_stream())
        self.real_gather(*args)
        event = torch.cuda.Event()
        event.record()  # behind the gather's wait: done once every rank's tokens are in
        self.gathered.append(event)

    def __enter__(self) -> _Spy:
        produce, project, gather = self.modules
        produce.project_down = project.project_down = self._down
        gather.start_token_gather = self._gather
        return self

    def __exit__(self, *exc) -> None:
        produce, project, gather = self.modules
        produce.project_down = project.project_down = self.real_down
        gather.start_token_gather = self.real_gather


def _watch(spy: _Spy, dev: torch.device, limit_s: float = 5.0) -> tuple[threading.Thread, dict]:
    """Poll, beside the op's host side, for the first moment the down-projection is done: was the gather?"""
    seen: dict = {}

    def run() -> None:
        torch.cuda.set_device(dev)
        start = time.monotonic()
        while time.monotonic() - start < limit_s:
            if spy.down and spy.gathered and spy.down[-1].query():
                seen["gather_done_at_down"] = spy.gathered[-1].query()
                seen["down_after_s"] = time.monotonic() - start
                return
            time.sleep(1e-4)
        seen["timed_out"] = True

    thread = threading.Thread(target=run)
    thread.start()
    return thread, seen


def _placement_worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    from latent_moe_fusion.ops.common.side_streams import side_stream
    from tests.test_route_gather_and_produce import _args, _gathered_reference

    os.environ["LMF_CHECK_IDS"] = "0"  # no host sync on the ids: the op returns with the gather in flight
    dev = torch.device("cuda", rank)
    block = _sp_block(dist.group.WORLD, dev)
    group_name = dist.group.WORLD.group_name
    op = torch.ops.lmf.route_gather_and_produce
    results = {}
    for m in TOKENS:
        gen = torch.Generator().manual_seed(seed + m)
        x = torch.randn(world, m, block.cfg.hidden_size, generator=gen)[rank].to(dev, torch.bfloat16)
        args = _args(block, x, group_name, world, router_gemm="bf16")
        op(**args)  # loads the kernels and warms NCCL: not observed
        torch.cuda.synchronize()
        dist.barrier()
        with _Spy() as spy:
            thread, seen = _watch(spy, dev)
            if rank == world - 1:
                time.sleep(LATE_S)  # the late rank: every other rank's gather waits for it
            y_n, ws = op(**args)
            thread.join()
        torch.cuda.synchronize()
        _, (want_y_n, want_ws) = _gathered_reference(args, group_name, world)
        torch.cuda.synchronize()
        results[m] = {
            "seen": seen,
            "gathers": len(spy.gathered),
            "on_shared_stream": [s == side_stream(dev, "shared_first") for s in spy.gather_streams],
            "bitwise": bool(torch.equal(y_n, want_y_n) and torch.equal(ws, want_ws)),
        }
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_gather_runs_beside_the_down_projection(world, rng_seed):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    results = run_gloo(_placement_worker, world, (rng_seed,), timeout=900, backend="nccl")
    for rank, per_m in enumerate(results):
        for m, res in per_m.items():
            assert res["gathers"] == 1 and res["on_shared_stream"] == [True], (rank, m, res)
            assert res["bitwise"], (rank, m, res)
            assert "timed_out" not in res["seen"], (rank, m, res)
            if rank != world - 1:  # the late rank's own gather may finish first: its peers were waiting
                assert res["seen"]["gather_done_at_down"] is False, (rank, m, res)


def _compiled_worker(rank: int, world: int, seed: int) -> dict:
    import torch.distributed as dist

    from latent_moe_fusion.fusion_pass import FusionConfig

    dev = torch.device("cuda", rank)
    model = _sp_block(dist.group.WORLD, dev)
    results = {}
    for m in TOKENS:
        gen = torch.Generator().manual_seed(seed + m)
        x = torch.randn(world, m, model.cfg.hidden_size, generator=gen)[rank].to(dev, torch.bfloat16)
        gathering, today = lmf.LatentMoEFusionPass(), lmf.LatentMoEFusionPass(FusionConfig(gather_tokens=False))
        fused, fused_today = compiled(model, gathering)(x), compiled(model, today)(x)
        eager = model(x)
        torch.cuda.synchronize()
        results[m] = {
            "gathers": [r.gathers_tokens for r in gathering.report.routings],
            "ops": (gathering.report.ops_after[ALL_GATHER], gathering.report.ops_after[ROUTE_GATHER_AND_PRODUCE]),
            "bitwise_today": bool(torch.equal(fused, fused_today)),
            "rel_eager": rel_l2(fused.cpu(), eager.cpu()),
        }
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_compiled_sp_block_is_bitwise_todays_rewrite(world, rng_seed):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    results = run_gloo(_compiled_worker, world, (rng_seed,), timeout=900, backend="nccl")
    for rank, per_m in enumerate(results):
        for m, res in per_m.items():
            assert res["gathers"] == [True] and res["ops"] == (0, 1), (rank, m, res)
            assert res["bitwise_today"], (rank, m, res)
            assert res["rel_eager"] <= 1.5e-2, (rank, m, res)
