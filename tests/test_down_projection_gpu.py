"""The down-projection's Triton path on the GPU (ops/routed/router_fused/down_projection.py) at Kimi K3 sizes (H = 7168 -> L = 3584):
against float64 as close as cuBLAS, every element written (NaN poison), bitwise the same run to run and inside
CUDA-graph replays, on strided inputs, and never in the way of the tail's split-K counters."""

import pytest
import torch

from latent_moe_fusion.ops.common.tail_gemm.tail_launch import tail_fused
from latent_moe_fusion.ops.routed.router_fused.down_projection import (
    DOWN_PROJECTION_ENV,
    TRITON_TABLE,
    project_down,
    triton_config,
)
from tests.graph_replay import replay_without_host_sync

pytestmark = pytest.mark.gpu

H, L = 7168, 3584


@pytest.fixture(scope="module")
def w_down():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(L, H, device="cuda", generator=gen) * H**-0.5).bfloat16()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16, 17, 32, 37, 64])
def test_as_close_to_float64_as_cublas(w_down, monkeypatch, rng_seed, m):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    assert triton_config(m) is not None
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, L), float("nan"), device="cuda", dtype=torch.bfloat16)
    project_down(x, w_down, out)
    ref = x.double() @ w_down.double().t()
    assert not out.isnan().any()
    err, cublas_err = _rel(out, ref), _rel(torch.mm(x, w_down.t()), ref)
    assert err < 1.25 * cublas_err + 1e-4, (err, cublas_err)
    again = torch.full_like(out, float("nan"))
    assert torch.equal(project_down(x, w_down, again), out)  # deterministic: fixed split-K order


def test_beyond_the_table_and_with_cublas_it_is_torch_mm(w_down, monkeypatch, rng_seed):
    x = torch.randn(TRITON_TABLE[-1][0] + 1, H, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    assert torch.equal(project_down(x, w_down, torch.empty(x.shape[0], L, device="cuda", dtype=x.dtype)),
                       torch.mm(x, w_down.t()))
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "cublas")
    x = x[:8]
    assert torch.equal(project_down(x, w_down, torch.empty(8, L, device="cuda", dtype=x.dtype)), torch.mm(x, w_down.t()))


@pytest.mark.parametrize("m", [4, 8])
def test_strided_rows(w_down, monkeypatch, rng_seed, m):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    wide = torch.randn(m, H + 24, device="cuda", dtype=torch.bfloat16)
    x = wide[:, 8:8 + H]  # rows 2 * (H + 24) bytes apart, base 16 bytes in
    out = torch.full((m, L), float("nan"), device="cuda", dtype=torch.bfloat16)
    project_down(x, w_down, out)
    assert torch.equal(out, project_down(x.contiguous(), w_down, torch.empty_like(out)))


@pytest.mark.parametrize("m", [2, 8, 48])
def test_captured_replays_with_fresh_inputs(w_down, monkeypatch, rng_seed, m):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    static_x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    static_out = torch.empty(m, L, device="cuda", dtype=torch.bfloat16)
    project_down(static_x, w_down, static_out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        project_down(static_x, w_down, static_out)
    for _ in range(20):
        static_x.copy_(torch.randn_like(static_x))
        static_out.fill_(float("nan"))
        replay_without_host_sync(graph)
        assert torch.equal(static_out, project_down(static_x, w_down, torch.empty_like(static_out)))


def test_beside_a_split_k_tail_on_another_stream(w_down, monkeypatch, rng_seed):
    """The down-projection (split-K at M <= 4) and a split-K tail on two streams at once: separate counters."""
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    assert triton_config(4).split_k > 1
    w_up = (torch.randn(H, L, device="cuda") * L**-0.5).bfloat16()
    side = torch.cuda.Stream()
    for _ in range(5):
        x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(4, L, device="cuda", dtype=torch.bfloat16)
        frags = torch.randn(1, 4, H, device="cuda", dtype=torch.bfloat16)
        z, out = torch.empty(4, L, device="cuda", dtype=x.dtype), torch.empty(4, H, device="cuda", dtype=x.dtype)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(8):
                project_down(x, w_down, z)
        for _ in range(8):
            tail_fused(y, w_up, frags, out)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        assert torch.equal(z, project_down(x, w_down, torch.empty_like(z)))
        assert torch.equal(out, tail_fused(y, w_up, frags, torch.empty_like(out)))
