"""lmf::route_and_project on the GPU: side by side on two streams, its outputs are bitwise those of the
calls it replaces (router GEMM, route kernel, the down-projection by the kernel LMF_DOWN_PROJECTION picks) at
Kimi K3 sizes, also captured in a CUDA graph; and a compiled block with the router beside the
down-projection gives bitwise the output of one without where both project down by cuBLAS, and agrees to
bf16 rounding with the default Triton down-projection (another FP32 summation order)."""

import pytest
import torch
import torch.nn.functional as F

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import FusionConfig
from latent_moe_fusion.model.router import router_logits
from latent_moe_fusion.ops.routed.router_fused.down_projection import DOWN_PROJECTION_ENV, project_down
from tests.graph_replay import replay_without_host_sync

pytestmark = pytest.mark.gpu

OP = torch.ops.lmf.route_and_project
H, E, L, K = 7168, 896, 3584, 16
FIRST, NUM_LOCAL = 112, 112  # one EP8 rank's share


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = (torch.randn(E, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
    bias = torch.randn(E, device="cuda", generator=gen) * 0.1
    w_down = (torch.randn(L, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
    return gate, bias, w_down


def _unfused(x, gate, bias, w_down, router_gemm):
    ids, w = torch.ops.lmf.noaux_tc_route(router_logits(x, gate, router_gemm), bias, K, 1e-20, 1.0, FIRST, NUM_LOCAL)
    z = torch.empty(x.shape[0], w_down.shape[0], device=x.device, dtype=x.dtype)
    return ids, w, project_down(x, w_down, z)


@pytest.mark.parametrize("down", ["triton", "cublas"])
@pytest.mark.parametrize("side_by_side", ["1", "0", "1,down"])
@pytest.mark.parametrize("router_gemm", ["bf16", "fp32"])
@pytest.mark.parametrize("m", [1, 8, 37, 128])
def test_bitwise_the_unfused_calls(weights, monkeypatch, tuned, rng_seed, m, router_gemm, side_by_side, down):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, down)
    if down == "cublas":
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(project_down(x, weights[2], torch.empty(m, L, device="cuda", dtype=x.dtype)),
                           F.linear(x, weights[2]))
    flag, _, order = side_by_side.partition(",")
    tuned(router_overlap_streams=flag, router_overlap_order=order or "router")
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    got = OP(x, *weights, router_gemm, K, 1e-20, 1.0, FIRST, NUM_LOCAL)
    for a, b in zip(got, _unfused(x, *weights, router_gemm), strict=True):
        assert torch.equal(a, b)
    z64 = x.double() @ weights[2].double().t()
    assert float((got[2].double() - z64).norm() / z64.norm()) < 8e-3


def test_captured_side_by_side_replays_match(weights, tuned, rng_seed):
    tuned(router_overlap_streams="1")
    static_x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        OP(static_x, *weights, "bf16", K, 1e-20, 1.0, FIRST, NUM_LOCAL)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = OP(static_x, *weights, "bf16", K, 1e-20, 1.0, FIRST, NUM_LOCAL)
    for out in static_out:
        out.fill_(-7)  # poison: every element must be rewritten by the replay
    for _ in range(20):
        static_x.copy_(torch.randn_like(static_x))
        replay_without_host_sync(graph)
        for a, b in zip(static_out, _unfused(static_x, *weights, "bf16"), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("down", ["cublas", "triton"])
@pytest.mark.parametrize("dynamic, sizes", [(False, (1,)), (False, (8,)), (True, (1, 8, 100))])
def test_compiled_block_matches_the_one_without_the_overlap(dynamic, sizes, rng_seed, monkeypatch, down):
    """dynamic: one graph for every size; the op then runs its parts side by side or in a row per call. Without
    the overlap the down-projection is Inductor's mm (cuBLAS): bitwise with cuBLAS inside the op, within bf16
    rounding with the Triton kernel."""
    monkeypatch.setenv(DOWN_PROJECTION_ENV, down)
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    model = lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=1,
                               router_gemm="bf16", ep_size=2, ep_rank=1)
    xs = [torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for m in sizes]
    outs, reports = [], []
    for config in (FusionConfig(), FusionConfig(overlap_router=False)):
        fpass = lmf.LatentMoEFusionPass(config)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):
            fn = torch.compile(model, options={"post_grad_custom_pre_pass": fpass}, dynamic=dynamic)
            outs.append([fn(x) for x in xs])
        reports.append(fpass.report)
    routing = reports[0].routings[0]
    assert reports[0].matched == 1 and routing.beside is not None, reports[0].summary()
    # the block's producer goes into lmf::route_and_produce where it is fed directly (tests/test_route_and_produce_gpu.py)
    assert ("[shared_first]" if routing.with_producer else "[side_stream]") in routing.beside
    assert reports[1].routings[0].beside is None
    for with_overlap, without in zip(*outs, strict=True):
        if down == "cublas":
            assert torch.equal(with_overlap, without)
        else:
            err = float((with_overlap.double() - without.double()).norm() / without.double().norm())
            assert err < 1e-2, err
