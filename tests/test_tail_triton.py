"""The Triton tail kernels at small sizes, on CPU through TRITON_INTERPRET=1 (set by conftest.py).

Each kernel (the CUDA-core GEMV, swap-AB with and without split-K, the tiled kernel, its descriptor variant) is called
through the launcher with an explicit small config and compared with a float64 reference; outputs
are poisoned with NaN first so that any element left unwritten fails the check.
"""

import pytest
import torch

from latent_moe_fusion.ops.common.backends import backends_for
from latent_moe_fusion.ops.common.tail_gemm import tail_launch as tail
from latent_moe_fusion.ops.common.tail_gemm.tail_gemm_configs import (
    BF16_TABLE,
    FP32_TABLE,
    TailConfig,
    fit_split_k,
    pick_config,
    table_config,
)
from latent_moe_fusion.ops.tail.triton import triton_tail_backend
from tests.launch_spy import LaunchSpy

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")

SMALL = {
    "gemv": TailConfig("gemv", 4, 8, 32, preload_k=128),
    "gemv_no_preload": TailConfig("gemv", 4, 16, 16, num_warps=2),
    "gemv_pipelined": TailConfig("gemv", 4, 8, 32, num_stages=3, preload_k=32),
    "swap": TailConfig("swap", 16, 16, 32),
    "swap_split2": TailConfig("swap", 16, 16, 32, split_k=2),
    "swap_split3": TailConfig("swap", 32, 32, 16, split_k=3),
    "swap_tma": TailConfig("swap_tma", 16, 16, 32),
    "swap_tma_split2": TailConfig("swap_tma", 16, 32, 16, split_k=2),
    "tile": TailConfig("tile", 16, 32, 32, group_m=2),
    "tile_persistent": TailConfig("tile", 16, 16, 32, group_m=2, persistent=True),
    "tile_tma": TailConfig("tile_tma", 16, 32, 32, group_m=2),
}


def _ref64(a: torch.Tensor, w: torch.Tensor, frags: torch.Tensor) -> torch.Tensor:
    acc = a.double() @ w.double().t()
    for r in range(frags.shape[0]):
        acc = acc + frags[r].double()
    return acc


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _fragments(r: int, m: int, n: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    if layout == "token_publish":  # ws [M, R, N] read as [R, M, N]
        return torch.randn(m, r, n, dtype=dtype).transpose(0, 1)
    return torch.randn(r, m, n, dtype=dtype)


def _check(name: str, m: int, n: int, k: int, r: int, dtype: torch.dtype, layout: str = "rmn") -> None:
    cfg = SMALL[name]
    a = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    frags = _fragments(r, m, n, dtype, layout)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    tail.tail_fused(a, w, frags, out=out, config=cfg)
    assert not out.isnan().any(), "unwritten output elements"
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    err = _rel_l2(out, _ref64(a, w, frags))
    assert err < tol, f"{name} M={m} N={n} K={k} R={r}: rel L2 {err:.3g}"


@pytest.mark.parametrize("name", list(SMALL))
def test_kernel_matches_float64(name, rng_seed):
    # Odd M, N and K: partial tiles everywhere, K tails masked.
    # (K = 72 keeps the descriptors' 16-byte row alignment; the pointer kernels also see a K tail.)
    m = 3 if name.startswith("gemv") else 5 if name.startswith("swap") and SMALL[name].block_m == 16 else 19
    _check(name, m=m, n=45, k=72, r=3, dtype=torch.bfloat16)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("k", [72, 64, 200])
def test_gemv_every_token_count_and_k(m, k, rng_seed):
    # M padded to 1 / 2 / 4; the preload is a power of two <= K (K = 72: 64 then a masked 8-column step;
    # K = 64: preload only, no loop step; K = 200: preload 128 then two steps, the last one masked).
    _check("gemv", m=m, n=45, k=k, r=2, dtype=torch.bfloat16)


def test_gemv_block_sizes():
    from latent_moe_fusion.ops.common.tail_gemm.tail_gemv import gemv_block_sizes

    assert gemv_block_sizes(1, 512, 1024, 3584) == (1, 512, 1024)
    assert gemv_block_sizes(3, 512, 1024, 3584) == (4, 128, 256)
    assert gemv_block_sizes(1, 512, 1024, 600) == (1, 512, 512)  # preload cut to a power of two <= K
    assert gemv_block_sizes(1, 512, 0, 3584) == (1, 512, 0)
    assert gemv_block_sizes(16, 64, 64, 3584) == (16, 16, 0)  # too small to preload


def test_gemv_rejects_more_tokens_than_its_bucket(rng_seed):
    a = torch.randn(5, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="does not serve M = 5"):  # SMALL["gemv"] serves M <= 4
        tail.tail_fused(a, torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(1, 5, 8, dtype=torch.bfloat16),
                        config=SMALL["gemv"])


@pytest.mark.parametrize("name", ["gemv", "swap", "swap_split2", "swap_tma_split2", "tile"])
def test_token_publish_strided_fragments(name, rng_seed):
    _check(name, m=3 if name == "gemv" else 7, n=48, k=64, r=2, dtype=torch.bfloat16, layout="token_publish")


@pytest.mark.parametrize("name", ["gemv", "swap_split2", "tile"])
def test_float32_inputs(name, rng_seed):
    _check(name, m=3, n=33, k=40, r=1, dtype=torch.float32)


def test_split_k_is_deterministic_and_resets_counters(rng_seed):
    a = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    frags = torch.randn(2, 4, 32, dtype=torch.bfloat16)
    first = tail.tail_fused(a, w, frags, config=SMALL["swap_split2"])
    second = tail.tail_fused(a, w, frags, config=SMALL["swap_split2"])
    assert torch.equal(first, second)
    assert int(tail._counters(a.device, 1).abs().sum()) == 0


def test_backend_serves_every_layout_on_cpu_tensors(rng_seed):
    # The registered fn (run here on CPU through the interpreter) against the reference op's math.
    m, h, lat = 3, 64, 32
    y_n = torch.randn(m, lat, dtype=torch.bfloat16)
    w_up = torch.randn(h, lat, dtype=torch.bfloat16)
    for mode, ws in (
        ("local", torch.randn(1, m, h, dtype=torch.bfloat16)),
        ("token_publish", torch.randn(m, 1, h, dtype=torch.bfloat16)),
        ("hidden_scatter", torch.randn(1, m, h, dtype=torch.bfloat16)),
    ):
        out = triton_tail_backend.tail_triton(y_n, w_up, ws, mode, None)
        frags = ws.transpose(0, 1) if mode == "token_publish" else ws
        assert _rel_l2(out, _ref64(y_n, w_up, frags)) < 1e-2, mode


def test_registration_and_reasons():
    names = [b.name for b in backends_for("latent_tail")]
    assert "triton" in names and "reference" in names
    backend = next(b for b in backends_for("latent_tail") if b.name == "triton")
    assert backend.priority == 10 and backend.device_types == ("cuda",)
    if not torch.cuda.is_available():
        assert "CUDA" in backend.available()
    y = torch.randn(2, 8, dtype=torch.float16)
    assert "float16" in backend.supports(y, y, y.unsqueeze(0), "local", None)
    y = torch.randn(2, 8, dtype=torch.bfloat16)
    assert backend.supports(y, torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(1, 2, 4, dtype=torch.bfloat16),
                            "local", None) is None


def test_config_table_covers_every_m():
    for table, fp32 in ((BF16_TABLE, False), (FP32_TABLE, True)):
        bounds = [b for b, _ in table]
        assert bounds == sorted(bounds)
        for m in (1, 2, 3, 16, 17, 100, 128, 129, 4096, 100_000):
            cfg = table_config(m, fp32)
            assert cfg.kernel not in ("swap", "swap_tma", "gemv") or cfg.block_m >= m
    # Narrow N (a hidden_scatter slice) raises split-K; the Kimi width does not.
    wide = pick_config(8, 7168, 3584, False, 132)
    assert wide == table_config(8, False)
    narrow = fit_split_k(table_config(8, False), 896, 3584, 132)
    assert narrow.split_k > wide.split_k


def test_gemv_override(tuned):
    from latent_moe_fusion.ops.common.tail_gemm.tail_gemm_configs import FEW_TOKENS_SWAP, GEMV_CONFIG, GEMV_OVERRIDE

    assert table_config(1, False) == GEMV_CONFIG and table_config(2, False) == GEMV_CONFIG
    assert table_config(3, False).kernel == "swap" and table_config(1, True).kernel == "swap"
    tuned(tail_gemv="off")
    assert table_config(1, False) == FEW_TOKENS_SWAP
    tuned(tail_gemv="16x256x2048w8")
    forced = table_config(2, False)
    assert (forced.kernel, forced.block_n, forced.block_k, forced.preload_k, forced.num_warps, forced.num_stages) == (
        "gemv", 16, 256, 2048, 8, 1)
    tuned(tail_gemv="4x512x0w2s3")
    assert (table_config(1, False).num_warps, table_config(1, False).num_stages) == (2, 3)
    assert table_config(3, False).kernel == "swap"  # the override acts on the few-token bucket only
    for bad in ("8x500x1024", "8x512", "fast", "8x512x1000", "8x512x1024s0"):
        with pytest.raises(ValueError, match=f"{GEMV_OVERRIDE}='{bad}'"):
            tuned(tail_gemv=bad)



@pytest.mark.parametrize("name", list(SMALL))
def test_int64_offsets_change_no_value(name, monkeypatch, rng_seed):
    """LARGE_OFFSETS (int64 element offsets, which the launcher sets where a tensor reaches past int32) reaches
    every kernel and computes the same bits as the int32 build: here forced on at a small size."""
    cfg = SMALL[name]
    m = 3 if name.startswith("gemv") else 5 if name.startswith("swap") else 19
    a = torch.randn(m, 72, dtype=torch.bfloat16)
    w = torch.randn(45, 72, dtype=torch.bfloat16)
    frags = _fragments(3, m, 45, torch.bfloat16, "token_publish")
    seen, asked = [], []
    for kernel in ("tail_gemv_kernel", "tail_swap_kernel", "tail_swap_tma_kernel", "tail_tile_kernel",
                   "tail_tile_tma_kernel"):
        monkeypatch.setattr(tail, kernel, LaunchSpy(getattr(tail, kernel), "LARGE_OFFSETS", seen))
    outs = []
    for large in (False, True):
        def forced(*tensors, large=large):
            asked.append(tensors)
            return large

        monkeypatch.setattr(tail, "needs_int64_offsets", forced)
        outs.append(torch.full((m, 45), float("nan"), dtype=torch.bfloat16))
        tail.tail_fused(a, w, frags, out=outs[-1], config=cfg)
    assert seen == [False, True]
    # The launcher asks about every tensor it addresses: the fragments and the output at least.
    assert len(asked) == 2
    for tensors, out in zip(asked, outs, strict=True):
        assert any(t is frags for t in tensors) and any(t is out for t in tensors)
    assert not outs[1].isnan().any() and torch.equal(outs[0], outs[1])
    assert _rel_l2(outs[1], _ref64(a, w, frags)) < 1e-2
