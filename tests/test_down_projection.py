"""The down-projection's kernel choice (ops/routed/router_fused/down_projection.py) and its Triton path at small sizes on CPU
(TRITON_INTERPRET=1, set by conftest.py): float64 reference, NaN-poisoned outputs; bad values fail with the
variable's (or override's) name and what it accepts."""

import pytest
import torch

from latent_moe_fusion.ops.common.tail_gemm.tail_gemm_configs import TailConfig
from latent_moe_fusion.ops.routed.router_fused.down_projection import (
    DOWN_PROJECTION_ENV,
    KERNEL_OVERRIDE,
    TRITON_TABLE,
    parse_swap_label,
    project_down,
    project_down_triton,
    triton_config,
)

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")


@pytest.mark.parametrize("cfg", [cfg for _, cfg in TRITON_TABLE], ids=lambda c: c.label())
def test_labels_name_their_configs(cfg):
    assert parse_swap_label(cfg.label()) == cfg


@pytest.mark.parametrize("label, says", [
    ("swap:16x32", "expected a swap kernel label"),
    ("tile:16x32x64/w4/st2/s1", "expected a swap kernel label"),
    ("cublas", "expected a swap kernel label"),
    (" ", "expected a swap kernel label"),
    ("swap:24x32x64/w4/st2/s1", "block_m = 24 is not a power of two"),
    ("swap:16x32x64/w3/st2/s1", "warps = 3 is not a power of two"),
    ("swap:16x32x64/w4/st9/s1", "stages 1 .. 8"),
    ("swap:8x32x64/w4/st2/s1", "block sizes must be >= 16"),
])
def test_bad_labels_say_what_is_accepted(tuned, label, says):
    with pytest.raises(ValueError, match=f"{KERNEL_OVERRIDE}=.*{says}"):
        tuned(down_projection_kernel=label)


@pytest.mark.parametrize("value", ["cuBLAS", " ", "swap:16x32x64/w4/st2/s1"])
def test_bad_variable_values_say_what_is_accepted(monkeypatch, value):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, value)
    with pytest.raises(ValueError, match=f"{DOWN_PROJECTION_ENV}=.*expected cublas or triton, or unset"):
        triton_config(8)


def test_the_default_is_the_table_then_cublas(monkeypatch):
    monkeypatch.delenv(DOWN_PROJECTION_ENV, raising=False)
    bounds = [0] + [bound for bound, _ in TRITON_TABLE]
    for (low, (high, cfg)) in zip(bounds, TRITON_TABLE, strict=False):
        for m in (low + 1, high):
            assert triton_config(m) == cfg
            assert cfg.block_m >= m
    assert triton_config(TRITON_TABLE[-1][0] + 1) is None


def test_cublas_and_a_label(monkeypatch, tuned):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "cublas")
    assert triton_config(1) is None
    tuned(down_projection_kernel="swap:32x64x128/w4/st3/s2")
    assert triton_config(1) is None  # cuBLAS: the numerics choice outranks a kernel label
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    assert triton_config(32) == TailConfig("swap", 32, 64, 128, num_warps=4, num_stages=3, split_k=2)
    assert triton_config(33) is None  # beyond the label's block_m: cuBLAS


def test_off_cuda_it_is_torch_mm_whatever_the_knob(monkeypatch, rng_seed):
    monkeypatch.setenv(DOWN_PROJECTION_ENV, "triton")
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
    out = torch.full((5, 48), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(project_down(x, w, out), torch.mm(x, w.t()))


@interpreter_only
@pytest.mark.parametrize("cfg", [cfg for _, cfg in TRITON_TABLE] + [TailConfig("swap", 16, 16, 32, split_k=3)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 3])
def test_triton_path_against_float64(cfg, m, rng_seed):
    # small L and H, not multiples of the tiles: masked rows and K tails are exercised
    x = torch.randn(m, 288, dtype=torch.bfloat16)
    w = torch.randn(80, 288, dtype=torch.bfloat16) * 288**-0.5
    out = torch.full((m, 80), float("nan"), dtype=torch.bfloat16)
    project_down_triton(x, w, out, cfg)
    ref = x.double() @ w.double().t()
    assert not out.isnan().any()
    assert float((out.double() - ref).norm() / ref.norm()) < 8e-3
