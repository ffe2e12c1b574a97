"""The shared expert's one-launch gate/up + SiTU (ops/shared_gate_up.py) on the H200 at Kimi K3 widths
(H = 7168, I_s = 768): as close to float64 as the library path (cuBLAS GEMM + SiTU pass), every element written
(NaN poison), bitwise run to run and in CUDA-graph replays without host sync; inside lmf::route_and_produce the
routed output is bitwise the one with cuBLAS and the fragments agree to bf16 rounding."""

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.ops.math import situ
from latent_moe_fusion.ops.route_and_produce import SHARED_FIRST_ENV
from latent_moe_fusion.ops.shared_gate_up import SHARED_GATE_UP_ENV, TABLE, gate_up_act, table_config, why_not
from latent_moe_fusion.ops.triton_kernels.situ_rows import situ_pair
from tests.graph_replay import replay_without_host_sync
from tests.test_route_and_produce_gpu import _args, _rel

pytestmark = pytest.mark.gpu

H, I_S = 7168, 768
BETA, LIN_BETA = 1.0, 1.0


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    merged = (torch.randn(2 * I_S, H, device="cuda", generator=gen) * 4 * H**-0.5).bfloat16()  # SiTU's curved range
    return merged[:I_S], merged[I_S:]


@pytest.fixture(scope="module")
def model():
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=1,
                              router_gemm="bf16", ep_size=2, ep_rank=1)


def _act(x, w1, w3, cfg):
    act = torch.full((x.shape[0], I_S), float("nan"), device="cuda", dtype=torch.bfloat16)
    return gate_up_act(x, w1, w3, act, BETA, LIN_BETA, cfg)


@pytest.mark.parametrize("m", [1, 5, 8, 13, 16, 17, 32, 37, 64])
def test_as_close_to_float64_as_the_library_path(weights, rng_seed, m):
    w1, w3 = weights
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    assert why_not(x, w1, w3) is None
    cfg = table_config(m)
    act = _act(x, w1, w3, cfg)
    assert not act.isnan().any()
    xd = x.double()
    want = situ(xd @ w1.double().t(), xd @ w3.double().t(), BETA, LIN_BETA)
    err, library_err = _rel(act, want), _rel(situ_pair(x @ w1.t(), x @ w3.t(), BETA, LIN_BETA), want)
    assert err < 1.25 * library_err + 1e-4, (err, library_err)
    assert torch.equal(act, _act(x, w1, w3, cfg))  # deterministic


def test_replays_in_a_cuda_graph_without_host_sync(weights, rng_seed):
    w1, w3 = weights
    static_x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    cfg = table_config(8)
    act = torch.empty(8, I_S, device="cuda", dtype=torch.bfloat16)
    gate_up_act(static_x, w1, w3, act, BETA, LIN_BETA, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gate_up_act(static_x, w1, w3, act, BETA, LIN_BETA, cfg)
    for _ in range(10):
        static_x.copy_(torch.randn_like(static_x))
        act.fill_(float("nan"))
        replay_without_host_sync(graph)
        assert torch.equal(act, _act(static_x, w1, w3, cfg))


def test_it_stands_aside_for_other_layouts(weights):
    w1, w3 = weights
    x = torch.randn(8, H, device="cuda", dtype=torch.bfloat16)
    assert "bfloat16" in why_not(x.half(), w1, w3)
    strided = torch.randn(8, 2 * H, device="cuda", dtype=torch.bfloat16)[:, ::2]
    assert "row-major" in why_not(strided, w1, w3)


@pytest.mark.parametrize("m", [5, 8, 32, TABLE[-1][0]])
def test_route_and_produce_with_it(model, monkeypatch, rng_seed, m):
    """Only the shared expert changes: the routed output is bitwise cuBLAS's run, the fragments agree to bf16
    rounding, and the block stays within bf16 tolerance of eager."""
    monkeypatch.setenv(SHARED_FIRST_ENV, "1")
    x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    args = _args(model, x)
    monkeypatch.setenv(SHARED_GATE_UP_ENV, "triton")
    y_n, ws = torch.ops.lmf.route_and_produce(*args)
    monkeypatch.setenv(SHARED_GATE_UP_ENV, "cublas")
    want_y_n, want_ws = torch.ops.lmf.route_and_produce(*args)
    assert torch.equal(y_n, want_y_n)
    assert 0 < _rel(ws, want_ws) < 1e-2  # not 0: the Triton kernel did run
    out = torch.ops.lmf.latent_tail(y_n, model.w_up, ws, "local", None)
    assert _rel(out, model(x)) < 1.5e-2
