"""Programmatic dependent launch on the GPU (ops/common/pdl.py): a forward with every PDL site on is bitwise the
forward with none, replay after replay with fresh inputs (a dependent that read its predecessor's output
before it was written would differ), in CUDA graphs and eagerly.

Kimi K3 shapes with one rank's share of the layer (64 local MXFP4 experts, shared expert 768 wide)."""

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion import tuning

pytestmark = pytest.mark.gpu

REPLAYS = 50


@pytest.fixture(scope="module")
def block():
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    torch.manual_seed(0)
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=0)


@pytest.fixture(scope="module")
def fused(block):
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    # torch.compile is lazy: the cache switch goes in its options, which hold for every compile it runs later (a
    # config.patch around the call would be over before the first compile, and a graph another process cached
    # would then be served without running the pass, leaving its report empty).
    fn = torch.compile(block, options={"post_grad_custom_pre_pass": fpass, "fx_graph_cache": False}, dynamic=False)
    return fn, fpass


def _capture(fn, static_x):
    for _ in range(2):  # compile for this M and warm up outside capture
        fn(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x)
    torch.cuda.synchronize()
    return graph, out


@pytest.mark.parametrize("m,routed_gemv", [(1, None), (1, False), (8, None), (32, None)])
def test_graph_with_pdl_is_bitwise_the_graph_without(block, fused, m, routed_gemv, tuned):
    """routed_gemv False: a token's routed experts on the MMA kernels, whose L2 is the routed PDL site."""
    fn, fpass = fused
    tuned(routed_gemv=routed_gemv)
    static_x = torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    tuned(pdl_sites="none")
    plain, plain_out = _capture(fn, static_x)
    assert fpass.report.matched == 1, fpass.report
    tuned(pdl_sites="all")
    dependent, dependent_out = _capture(fn, static_x)
    for _ in range(REPLAYS):
        static_x.copy_(torch.randn_like(static_x))
        plain.replay()
        dependent.replay()
        assert torch.equal(dependent_out, plain_out)
    ref = block(static_x)
    err = float((dependent_out.double() - ref.double()).norm() / ref.double().norm())
    assert err <= 1e-2, err


@pytest.mark.parametrize("m", (1, 8))
def test_eager_ops_with_pdl_see_their_inputs_written_just_before(block, m):
    """The tail launched right after a kernel that rewrites its input, outside graphs."""
    w_up = block.w_up
    y_n = torch.randn(m, w_up.shape[1], device="cuda", dtype=torch.bfloat16)
    ws = torch.randn(1, m, w_up.shape[0], device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        fresh = torch.randn_like(y_n)
        y_n.copy_(fresh)
        with tuning.overrides(pdl_sites="none"):
            ref = torch.ops.lmf.latent_tail(y_n, w_up, ws, "local", None)
        y_n.zero_()
        y_n.add_(fresh)  # the kernel the dependent tail follows writes its input
        with tuning.overrides(pdl_sites="all"):
            out = torch.ops.lmf.latent_tail(y_n, w_up, ws, "local", None)
        assert torch.equal(out, ref)
