"""The Triton latent tail on a CUDA GPU: correctness, determinism, CUDA-graph capture and replay.

Shapes are random (M not a multiple of any tile, odd N and K), every table bucket is hit, fragments
come in all three layouts and as strided views with R up to 8; outputs are poisoned with NaN first.
"""

import random

import pytest
import torch

from latent_moe_fusion.ops import latent_tail
from latent_moe_fusion.ops.common.tail_gemm import tail_launch as tail
from latent_moe_fusion.ops.common.tail_gemm.tail_gemm_configs import BF16_TABLE, FP32_TABLE, TailConfig

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2
FP32_TOL = 1e-5


def _ref64(a, w, frags):
    acc = a.double() @ w.double().t()
    for r in range(frags.shape[0]):
        acc = acc + frags[r].double()
    return acc


def _rel_l2(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def _poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), dtype=dtype, device="cuda")


def _run_checked(a, w, frags, tol, config=None):
    out = tail.tail_fused(a, w, frags, out=_poisoned(a.shape[0], w.shape[0], a.dtype), config=config)
    assert not out.isnan().any(), "unwritten output elements"
    err = _rel_l2(out, _ref64(a, w, frags))
    assert err < tol, f"M={a.shape[0]} N={w.shape[0]} K={a.shape[1]} R={frags.shape[0]} cfg={config}: rel L2 {err:.3g}"
    return out


def _random_shapes(seed, count):
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        m = rng.choice([1, 2, 3, 5, 7, 13, 16, 17, 31, 33, 63, 65, 100, 127, 128, 129, 250, 300, 517])
        n = rng.choice([7168, 896, 1000, 333, 4096])
        k = rng.choice([3584, 448, 520, 1000, 200])
        r = (1, 2, 8)[i % 3]
        shapes.append((m, n, k, r))
    return shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_shapes_against_float64(dtype, rng_seed):
    for m, n, k, r in _random_shapes(rng_seed, 12):
        a = torch.randn(m, k, dtype=dtype, device="cuda")
        w = torch.randn(n, k, dtype=dtype, device="cuda")
        if r > 1 and m % 2:  # token_publish-style strided view
            frags = torch.randn(m, r, n, dtype=dtype, device="cuda").transpose(0, 1)
        else:
            frags = torch.randn(r, m, n, dtype=dtype, device="cuda")
        _run_checked(a, w, frags, BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)


@pytest.mark.parametrize("table", ["bf16", "fp32"])
def test_every_table_config_at_kimi_sizes(table, rng_seed):
    dtype = torch.bfloat16 if table == "bf16" else torch.float32
    entries = BF16_TABLE if table == "bf16" else FP32_TABLE
    w = torch.randn(7168, 3584, dtype=dtype, device="cuda")
    lower = 0
    for bound, cfg in entries:
        m = min(bound, lower + 37)  # inside the bucket, not a tile multiple where possible
        lower = bound
        a = torch.randn(m, 3584, dtype=dtype, device="cuda")
        frags = torch.randn(m, 8, 7168, dtype=dtype, device="cuda").transpose(0, 1)  # R = 8, strided
        _run_checked(a, w, frags, BF16_TOL if dtype == torch.bfloat16 else FP32_TOL, config=cfg)


# Every kernel variant (not only those in the table), each with an odd M and R = 8 strided fragments.
VARIANTS = [
    TailConfig("gemv", 4, 8, 512, preload_k=1024),
    TailConfig("gemv", 4, 16, 256, num_warps=2, preload_k=0),
    TailConfig("gemv", 8, 4, 1024, num_warps=4, preload_k=2048),
    TailConfig("gemv", 4, 4, 512, num_warps=2, num_stages=3, preload_k=1024),
    TailConfig("swap", 16, 64, 128, split_k=4),
    TailConfig("swap_tma", 16, 64, 128, split_k=2),
    TailConfig("swap_tma", 64, 128, 64, num_warps=8, split_k=1),
    TailConfig("tile", 128, 256, 64, num_warps=8, persistent=True),
    TailConfig("tile_tma", 64, 128, 64, num_warps=4, num_stages=4, persistent=True),
]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: c.label())
def test_every_kernel_variant(cfg, rng_seed):
    m = 3 if cfg.kernel == "gemv" else 13 if cfg.kernel.startswith("swap") else 301
    a = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")
    frags = torch.randn(m, 8, 7168, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
    _run_checked(a, w, frags, BF16_TOL, config=cfg)


@pytest.mark.parametrize("mode", ["local", "token_publish", "hidden_scatter"])
@pytest.mark.parametrize("m", [1, 9, 128, 300])
def test_op_matches_reference_backend(mode, m, monkeypatch, rng_seed):
    y_n = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
    w_up = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")
    ws = torch.randn((m, 1, 7168) if mode == "token_publish" else (1, m, 7168), dtype=torch.bfloat16, device="cuda")
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "reference")
    ref = latent_tail(y_n, w_up, ws, mode)
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "triton")
    _poisoned(m, 7168, torch.bfloat16)  # freed NaN block: the op's torch.empty is likely to reuse it
    out = latent_tail(y_n, w_up, ws, mode)
    assert not out.isnan().any()
    frags = ws.transpose(0, 1) if mode == "token_publish" else ws
    ref64 = _ref64(y_n, w_up, frags)
    assert _rel_l2(out, ref64) < BF16_TOL
    # Same rounding points as the reference op: the two differ only by fp32 accumulation order.
    assert _rel_l2(out, ref.double()) < BF16_TOL


@pytest.mark.parametrize("m", [1, 4])
def test_triton_is_the_default_cuda_backend(m):
    """Triton serves the tail on CUDA unless the CuTe DSL is installed and its measured table picks the bucket
    (M = 3 .. 64 in tail_cute_choice.json; never M <= 2, the GEMV's)."""
    from latent_moe_fusion.ops.common.backends import select_backend
    from latent_moe_fusion.ops.tail.cute import tail_backend

    y = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")
    ws = torch.randn(1, m, 7168, dtype=torch.bfloat16, device="cuda")
    cute_picks = tail_backend.available() is None and tail_backend.supports(y, w, ws, "local") is None
    assert not (m <= 2 and cute_picks)
    want = "cute" if cute_picks else "triton"
    assert select_backend("latent_tail", "cuda", y, w, ws, "local", None).name == want


@pytest.mark.parametrize("m", [1, 3, 40, 100, 700])
def test_deterministic_run_to_run(m, rng_seed):
    a = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")
    frags = torch.randn(8, m, 7168, dtype=torch.bfloat16, device="cuda")
    first = tail.tail_fused(a, w, frags)
    for _ in range(3):
        assert torch.equal(tail.tail_fused(a, w, frags), first)


@pytest.mark.parametrize("m", [1, 4, 24, 64, 128, 256])
def test_cuda_graph_capture_and_replay(m, rng_seed):
    tail.warmup(m_values=(m,), r_values=(8,))
    a = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")
    ws = torch.randn(m, 8, 7168, dtype=torch.bfloat16, device="cuda")  # token_publish layout, R = 8
    frags = ws.transpose(0, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tail.tail_fused(a, w, frags)
    for _ in range(3):  # fresh inputs copied into the captured buffers, then replay
        a.copy_(torch.randn_like(a))
        ws.copy_(torch.randn_like(ws))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert _rel_l2(out, _ref64(a, w, frags)) < BF16_TOL
        assert torch.equal(out, tail.tail_fused(a, w, frags))  # replay == eager, bitwise


@pytest.mark.parametrize("spec", ["off", "8x512x0", "16x256x2048w8", "4x512x1024w2s3"])
def test_gemv_override_serves_a_few_tokens(spec, tuned, rng_seed):
    # Every tail_gemv override the tuning sweep uses computes the same function as the default.
    tuned(tail_gemv=spec)
    for m in (1, 2):
        a = torch.randn(m, 3584, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(7168, 3584, dtype=torch.bfloat16, device="cuda")
        _run_checked(a, w, torch.randn(1, m, 7168, dtype=torch.bfloat16, device="cuda"), BF16_TOL)
