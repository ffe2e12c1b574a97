"""The one-launch decode front (ops/front.py) on the H200 at Kimi K3 widths (H = 7168, L = 3584, I_s = 768):
z bitwise the Triton down-projection's, act as close to float64 as the library path (cuBLAS gate/up + SiTU
pass), every element written (NaN poison), bitwise run to run and in CUDA-graph replays without host sync;
inside lmf::route_and_produce the routed output is bitwise the one without it and the block stays within
bf16 tolerance of eager, also compiled with the pass."""

import sys

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import FusionConfig
from latent_moe_fusion.ops import front as front_mod
from latent_moe_fusion.ops.down_projection import DOWN_PROJECTION_ENV, project_down, table_config
from latent_moe_fusion.ops.front import FRONT_ENV, front_config, front_fused, why_not
from latent_moe_fusion.ops.math import situ
from latent_moe_fusion.ops.triton_kernels.situ_rows import situ_pair
from tests.graph_replay import replay_without_host_sync
from tests.test_route_and_produce_gpu import _args, _rel

pytestmark = pytest.mark.gpu

H, L, I_S = 7168, 3584, 768
BETA, LIN_BETA = 1.0, 1.0


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)

    def w(n: int) -> torch.Tensor:
        return (torch.randn(n, H, device="cuda", generator=gen) * H**-0.5).bfloat16()

    merged = torch.cat([w(I_S), w(I_S)]) * 4  # the gate / up products reach SiTU's curved range
    return w(L), merged[:I_S], merged[I_S:]


@pytest.fixture(scope="module")
def model():
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=1,
                              router_gemm="bf16", ep_size=2, ep_rank=1)


def _run(x, w_down, w1, w3, cfg):
    z = torch.full((x.shape[0], L), float("nan"), device="cuda", dtype=torch.bfloat16)
    act = torch.full((x.shape[0], I_S), float("nan"), device="cuda", dtype=torch.bfloat16)
    front_fused(x, w_down, w1, w3, z, act, BETA, LIN_BETA, cfg)
    return z, act


@pytest.mark.parametrize("m", [5, 8, 13, 16, 17, 32, 37, 64])
def test_against_float64_and_the_separate_kernels(weights, monkeypatch, rng_seed, m):
    monkeypatch.delenv(FRONT_ENV, raising=False)
    monkeypatch.delenv(DOWN_PROJECTION_ENV, raising=False)
    w_down, w1, w3 = weights
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    assert why_not(x, x, w_down, w1, w3) is None
    cfg = front_config(m)
    z, act = _run(x, w_down, w1, w3, cfg)
    assert not z.isnan().any() and not act.isnan().any()
    xd = x.double()
    down = table_config(m)
    if (down.split_k, down.block_m, down.block_k) == (1, cfg.block_m, cfg.block_k):
        assert torch.equal(z, project_down(x, w_down, torch.empty_like(z)))  # the down-projection's own bits
    ref_z = xd @ w_down.double().t()
    assert _rel(z, ref_z) < 1.25 * _rel(x @ w_down.t(), ref_z) + 1e-4
    want = situ(xd @ w1.double().t(), xd @ w3.double().t(), BETA, LIN_BETA)
    library = situ_pair(x @ w1.t(), x @ w3.t(), BETA, LIN_BETA)
    err, library_err = _rel(act, want), _rel(library, want)
    assert err < 1.25 * library_err + 1e-4, (err, library_err)
    z2, act2 = _run(x, w_down, w1, w3, cfg)
    assert torch.equal(z, z2) and torch.equal(act, act2)  # deterministic


def test_replays_in_a_cuda_graph_without_host_sync(weights, rng_seed):
    w_down, w1, w3 = weights
    static_x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    cfg = front_config(8)
    z = torch.empty(8, L, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(8, I_S, device="cuda", dtype=torch.bfloat16)
    front_fused(static_x, w_down, w1, w3, z, act, BETA, LIN_BETA, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        front_fused(static_x, w_down, w1, w3, z, act, BETA, LIN_BETA, cfg)
    for _ in range(10):
        static_x.copy_(torch.randn_like(static_x))
        z.fill_(float("nan"))
        act.fill_(float("nan"))
        replay_without_host_sync(graph)
        want_z, want_act = _run(static_x, w_down, w1, w3, cfg)
        assert torch.equal(z, want_z) and torch.equal(act, want_act)


def test_it_stands_aside_for_other_tokens_and_layouts(weights):
    w_down, w1, w3 = weights
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    assert "x_s is not x" in why_not(x, x.clone(), w_down, w1, w3)
    assert "bfloat16" in why_not(x.half(), x.half(), w_down, w1, w3)
    strided = torch.randn(8, 2 * H, device="cuda", dtype=torch.bfloat16)[:, ::2]
    assert "row-major" in why_not(strided, strided, w_down, w1, w3)


@pytest.mark.parametrize("m", [5, 8, 32, 64])
def test_route_and_produce_with_the_front(model, monkeypatch, rng_seed, m):
    """The routed output is bitwise the one without the front where z is (the same kernel steps); the fragments
    agree to bf16 rounding."""
    calls = []
    real = front_mod.front_fused
    module = sys.modules["latent_moe_fusion.ops.route_and_produce"]  # the package's attribute is the op
    monkeypatch.setattr(module, "front_fused", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    args = _args(model, x)
    monkeypatch.delenv(FRONT_ENV, raising=False)
    y_n, ws = torch.ops.lmf.route_and_produce(*args)
    assert calls == [m]
    monkeypatch.setenv(FRONT_ENV, "0")
    want_y_n, want_ws = torch.ops.lmf.route_and_produce(*args)
    assert calls == [m]
    cfg, down = front_config(m), table_config(m)
    if (down.split_k, down.block_m, down.block_k) == (1, cfg.block_m, cfg.block_k):
        assert torch.equal(y_n, want_y_n)  # the same z
    else:
        assert _rel(y_n, want_y_n) < 1e-2
    assert _rel(ws, want_ws) < 1e-2
    out = torch.ops.lmf.latent_tail(y_n, model.w_up, ws, "local", None)
    assert _rel(out, model(x)) < 1.5e-2


@pytest.mark.parametrize("m", [8, 32])
def test_compiled_block_with_the_front_in_a_cuda_graph(model, monkeypatch, rng_seed, m):
    monkeypatch.delenv(FRONT_ENV, raising=False)
    fpass = lmf.LatentMoEFusionPass(FusionConfig())
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        fn = torch.compile(model, options={"post_grad_custom_pre_pass": fpass}, dynamic=False)
        static_x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            fn(static_x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(static_x)
    for _ in range(5):
        static_x.copy_(torch.randn_like(static_x))
        static_out.fill_(float("nan"))
        replay_without_host_sync(graph)
        assert _rel(static_out, model(static_x)) < 1.5e-2
