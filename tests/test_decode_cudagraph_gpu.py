"""Decode under CUDA graphs: the compiled + fused block captured and replayed.

Kimi K3 shapes (H 7168, L 3584, I 3072, top-16) with one rank's share of the layer: 64 local
experts in MXFP4 and a 768-wide shared expert (TP8's shard), R = 1.
"""

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.ops.common.tail_gemm import tail_launch as triton_tail
from latent_moe_fusion.ops.routed.router_fused.route_and_produce import SHARED_FIRST_MAX_TOKENS
from latent_moe_fusion.ops.routed.router_fused.route_and_project import OVERLAP_MAX_TOKENS

pytestmark = pytest.mark.gpu

DECODE_M = (1, 8, 32, 128)
REPLAYS = 100


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def block():
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    torch.manual_seed(0)
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=0)


def _beside_up_to(fpass) -> int:
    """Up to how many tokens the pass puts the router beside the down-projection in this graph."""
    with_producer = any(r.with_producer for r in fpass.report.routings)
    return SHARED_FIRST_MAX_TOKENS if with_producer else OVERLAP_MAX_TOKENS


def _compiled(block, cudagraphs: bool = False):
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    # mode="reduce-overhead" is options["triton.cudagraphs"] = True; torch.compile refuses mode and
    # options together, and the pass goes in through options.
    options = {"post_grad_custom_pre_pass": fpass, "triton.cudagraphs": cudagraphs}
    with torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(block, options=options, dynamic=False)
    return fn, fpass


@pytest.mark.parametrize("m", DECODE_M)
def test_manual_cuda_graph_replays_match_eager(block, m):
    fn, fpass = _compiled(block)
    static_x = torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch._inductor.config.patch(fx_graph_cache=False):
        for _ in range(3):  # compile, autotune and warm up outside capture
            fn(static_x)
    assert fpass.report.matched == 1, fpass.report
    # the router beside the down-projection up to OVERLAP_MAX_TOKENS, with the producer up to SHARED_FIRST_MAX_TOKENS
    # (router_overlap.py), in a row beyond
    assert [r.beside is not None for r in fpass.report.routings] == [m <= _beside_up_to(fpass)], fpass.report.summary()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_x)
    torch.cuda.synchronize()
    mem_before = torch.cuda.memory_allocated()
    worst = 0.0
    for _ in range(REPLAYS):
        x = torch.randn_like(static_x)
        static_x.copy_(x)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref = block(x)
        worst = max(worst, _rel_l2(static_out, ref))
        assert torch.isfinite(static_out).all()
    del x, ref
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == mem_before, "replays changed the allocated GPU memory"
    assert worst <= 1e-2, f"worst replay rel L2 {worst:.3e}"


@pytest.mark.parametrize("m", DECODE_M)
def test_reduce_overhead_mode_replays_match_eager(block, m, monkeypatch):
    # As in a fresh process: the split-K counters (tail and down-projection) are first made inside the cudagraph
    # tree's warm-up, whose pool must not hold them (the tree then refused to record).
    monkeypatch.setattr(triton_tail, "_COUNTERS", {})
    fn, fpass = _compiled(block, cudagraphs=True)
    xs = [torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(REPLAYS + 3)]
    with torch._inductor.config.patch(fx_graph_cache=False):
        for x in xs[:3]:  # compile, warm up and record the cudagraph tree
            torch.compiler.cudagraph_mark_step_begin()
            fn(x)
    assert fpass.report.matched == 1, fpass.report
    # the router beside the down-projection up to OVERLAP_MAX_TOKENS, with the producer up to SHARED_FIRST_MAX_TOKENS
    # (router_overlap.py), in a row beyond
    assert [r.beside is not None for r in fpass.report.routings] == [m <= _beside_up_to(fpass)], fpass.report.summary()
    torch.cuda.synchronize()
    mem_before = None
    worst = 0.0
    for i, x in enumerate(xs[3:]):  # fresh inputs: cudagraph trees copy each into the graph's static input
        torch.compiler.cudagraph_mark_step_begin()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fn(x).clone()  # the graph's output buffer is reused by the next replay
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(out).all()
        worst = max(worst, _rel_l2(out, block(x)))
        del out
        if i == 0:
            torch.cuda.synchronize()
            mem_before = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == mem_before, "replays changed the allocated GPU memory"
    assert worst <= 1e-2, f"worst replay rel L2 {worst:.3e}"
