"""CuTe DSL tail kernel on an H100/H200: against a float64 reference on random shapes (M not
a multiple of the tile, K longer and shorter than the pipeline), poisoned outputs, every fragment
layout, the op path, determinism, the current stream, CUDA-graph capture + replay, and the programmatic
dependent launch (bitwise the plain one, also behind a kernel that signals early and writes its input).

Kernels compile once per (R, tile config); the cases stay within R in {1, 8} and the buckets that
bench/tail_cute.py also measures, so a run of both in one process compiles each kernel once.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed"),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="the CuTe tail kernel needs an sm_90 GPU",
    ),
]

TOL = 6e-3  # BF16 output rounding (~2.3e-3 relative L2) plus FP32 accumulation-order differences


def _inputs(m, k, n, r, mode="local", dtype=torch.bfloat16):
    y = torch.randn(m, k, device="cuda", dtype=dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    shape = (m, r, n) if mode == "token_publish" else (r, m, n)
    ws = torch.randn(shape, device="cuda", dtype=dtype)
    frags = ws.transpose(0, 1) if mode == "token_publish" else ws
    return y, w, ws, frags


def _reference64(y, w, frags):
    acc = y.double() @ w.double().t()
    for r in range(frags.shape[0]):
        acc = acc + frags[r].double()
    return acc


def _rel_l2(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def _poisoned(m, n, dtype=torch.bfloat16):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


CASES = [  # (M, K, N, R, mode): K/64 below and above the 8-stage decode ring, ragged M in every bucket
    (1, 1536, 512, 1, "local"),
    (5, 128, 256, 8, "token_publish"),
    (8, 3584, 1024, 8, "local"),
    (20, 1536, 768, 1, "token_publish"),
    (32, 1536, 512, 8, "local"),
    (77, 1536, 384, 8, "token_publish"),
    (128, 1024, 256, 1, "local"),
    (200, 1536, 640, 8, "local"),
    (300, 2048, 384, 1, "token_publish"),
]


@pytest.mark.parametrize(("m", "k", "n", "r", "mode"), CASES)
def test_matches_float64_reference(m, k, n, r, mode, rng_seed):
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused

    y, w, _, frags = _inputs(m, k, n, r, mode)
    out = tail_cute_fused(y, w, frags, out=_poisoned(m, n))
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten output elements"
    assert _rel_l2(out, _reference64(y, w, frags)) < TOL


def test_hidden_scatter_column_slice(rng_seed):
    """hidden_scatter on rank q of 8: this rank's rows of the full w_up, fragments [R, M, H/R]."""
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused

    m, k, hidden, world, q = 9, 1024, 2048, 8, 3
    cols = hidden // world
    y, w_full, _, _ = _inputs(m, k, hidden, 1)
    ws = torch.randn(world, m, cols, device="cuda", dtype=torch.bfloat16)
    w = w_full[q * cols : (q + 1) * cols]
    out = tail_cute_fused(y, w, ws, out=_poisoned(m, cols))
    assert _rel_l2(out, _reference64(y, w, ws)) < TOL


def test_op_path_forced_and_deterministic(monkeypatch, rng_seed):
    import latent_moe_fusion  # noqa: F401  (registers torch.ops.lmf)
    from latent_moe_fusion.ops.common.backends import select_backend
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused

    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "cute")
    # Without a process group the op takes R = 1 fragment ([M, 1, H] in token_publish).
    y, w, ws, frags = _inputs(31, 1536, 512, 1, "token_publish")
    assert select_backend("latent_tail", "cuda", y, w, ws, "token_publish", None).name == "cute"
    first = torch.ops.lmf.latent_tail(y, w, ws, "token_publish")
    second = torch.ops.lmf.latent_tail(y, w, ws, "token_publish")
    assert torch.equal(first, second)
    assert torch.equal(first, tail_cute_fused(y, w, frags))
    assert _rel_l2(first, _reference64(y, w, frags)) < TOL


def test_runs_on_the_current_stream(rng_seed):
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y, w, _, frags = _inputs(64 + 3, 1536, 512, 1)  # produced on the side stream, consumed right after
        out = tail_cute_fused(y, w, frags, out=_poisoned(67, 512))
        ref = _reference64(y, w, frags)
    side.synchronize()
    assert _rel_l2(out, ref) < TOL


def test_capture_and_replay(rng_seed):
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused, warmup

    m, k, n, r = 6, 3584, 1024, 8
    warmup(m_values=[m], num_frags=[r])
    static = _inputs(m, k, n, r)
    y, w, _, frags = static
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tail_cute_fused(y, w, frags)
    for _ in range(3):
        fresh = _inputs(m, k, n, r)
        for dst, src in zip((y, w, frags), (fresh[0], fresh[1], fresh[3]), strict=True):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_l2(out, _reference64(y, w, frags)) < TOL


def test_capture_without_warmup_raises_clearly():
    from latent_moe_fusion.ops.tail.cute import CuteCompileDuringCapture, tail_cute_fused

    y, w, _, frags = _inputs(4, 128, 256, 2)  # R = 2: compiled by no other test
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CuteCompileDuringCapture, match="warmup"):
        with torch.cuda.graph(graph):
            tail_cute_fused(y, w, frags)


@pytest.mark.parametrize(("m", "k", "n", "r"), [(1, 1536, 512, 1), (8, 3584, 1024, 8), (32, 1536, 512, 8),
                                                (77, 1536, 384, 8), (200, 1536, 640, 8), (5, 128, 256, 8)])
def test_programmatic_dependent_launch_is_bitwise_the_plain_one(m, k, n, r, rng_seed):
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused

    y, w, _, frags = _inputs(m, k, n, r)
    plain = tail_cute_fused(y, w, frags, out=_poisoned(m, n), pdl=False)
    dependent = tail_cute_fused(y, w, frags, out=_poisoned(m, n), pdl=True)
    assert torch.equal(plain, dependent)
    assert _rel_l2(dependent, _reference64(y, w, frags)) < TOL


@pytest.mark.parametrize("m", [8, 32])
def test_dependent_launch_waits_for_the_combine_that_signals_early(m, tuned, rng_seed):
    """The producer's combine signals its dependents first thing, then writes y_n: the tail launched behind
    it in a captured graph must read the y_n of this replay (poisoned output, fresh pairs every replay)."""
    from latent_moe_fusion.ops.routed.triton.combine import launch_combine
    from latent_moe_fusion.ops.tail.cute import tail_cute_fused, warmup

    tuned(pdl_sites="tail")
    k, n, r, top_k = 3584, 2048, 1, 4
    warmup(m_values=[m], num_frags=[r])
    pairs = torch.randn(m * top_k, k, device="cuda")
    ids = torch.randint(0, 16, (m, top_k), device="cuda", dtype=torch.int32)
    weights = torch.rand(m, top_k, device="cuda")
    norm = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    y = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    _, w, _, frags = _inputs(m, k, n, r)
    for _ in range(2):
        launch_combine(pairs, ids, weights, y, norm, 1e-5)
        tail_cute_fused(y, w, frags)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_combine(pairs, ids, weights, y, norm, 1e-5)
        out = tail_cute_fused(y, w, frags)
    for _ in range(10):
        pairs.copy_(torch.randn_like(pairs))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = tail_cute_fused(y, w, frags, out=_poisoned(m, n), pdl=False)  # y as this replay's combine wrote it
        assert torch.equal(out, want)
        launch_combine(pairs, ids, weights, y, norm, 1e-5)  # and y is that of these pairs
        assert torch.equal(out, tail_cute_fused(y, w, frags, out=_poisoned(m, n), pdl=False))
