"""The shared expert's GEMMs on the tail's swap-AB kernel (LMF_SHARED_GEMMS=triton, shared_by_library.py) on the
GPU at Kimi K3 rank sizes: as close to float64 as the cuBLAS form, every fragment element written, and the
fused block's two paths (lmf::route_and_produce and the two ops) still bitwise one another."""

import pytest
import torch

from latent_moe_fusion.ops.triton_kernels.shared_by_library import SHARED_GEMMS_ENV, _swap_config, shared_by_library
from latent_moe_fusion.ops.triton_kernels.situ_rows import situ_pair

pytestmark = pytest.mark.gpu

H, I_S, BETA, LIN_BETA = 7168, 768, 10.0, 25.0


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(2 * I_S, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
    w2 = (torch.randn(H, I_S, device="cuda", generator=gen) * I_S**-0.5).bfloat16()
    return w13[:I_S], w13[I_S:], w2


def _float64(x, w1, w3, w2):
    g, u = x.double() @ w1.double().t(), x.double() @ w3.double().t()
    act = situ_pair(g.bfloat16(), u.bfloat16(), BETA, LIN_BETA).double()
    return act @ w2.double().t()


@pytest.mark.parametrize("m", [3, 5, 8, 16, 17, 32])
def test_as_close_to_float64_as_cublas(weights, monkeypatch, rng_seed, m):
    x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    ref = _float64(x, *weights)
    outs = {}
    for choice in ("cublas", "triton"):
        monkeypatch.setenv(SHARED_GEMMS_ENV, choice)
        out = torch.full((m, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        shared_by_library(x, *weights, out, BETA, LIN_BETA)
        assert not out.isnan().any()
        outs[choice] = float((out.double() - ref).norm() / ref.norm())
    monkeypatch.setenv(SHARED_GEMMS_ENV, "triton")
    assert _swap_config(x, 2 * I_S) is not None
    assert outs["triton"] < 1.25 * outs["cublas"] + 1e-4, outs


def test_beyond_decode_sizes_it_is_cublas(weights, monkeypatch, rng_seed):
    monkeypatch.setenv(SHARED_GEMMS_ENV, "triton")
    x = torch.randn(33, H, device="cuda", dtype=torch.bfloat16)
    assert _swap_config(x, 2 * I_S) is None
    monkeypatch.setenv(SHARED_GEMMS_ENV, "cuBLAS")
    with pytest.raises(ValueError, match=f"{SHARED_GEMMS_ENV}='cuBLAS': expected one of cublas, triton"):
        _swap_config(x, 2 * I_S)
