"""DeepGEMM capability probe and the fallback when DeepGEMM is absent (CPU, fake module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from latent_moe_fusion.ops.common.backends import explain
from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4
from latent_moe_fusion.ops.common.reference_math import routed_experts_math
from latent_moe_fusion.ops.routed import deepgemm
from latent_moe_fusion.ops.routed.deepgemm import probe
from latent_moe_fusion.ops.routed.deepgemm.probe import SM90_GROUPED, SM100_MEGA, parameter_names, probe_deepgemm
from tests.deepgemm_fake import FakeDeepGemm, install


@pytest.fixture(autouse=True)
def _clean_state():
    deepgemm.reset_deepgemm_state()
    yield
    deepgemm.reset_deepgemm_state()


def test_importing_the_package_does_not_import_deep_gemm():
    # A fresh interpreter: another test of this session may have imported the real deep_gemm.
    code = (
        "import sys, latent_moe_fusion\n"
        "from latent_moe_fusion.ops.common.backends import backends_for\n"
        "assert 'deep_gemm' not in sys.modules, 'importing latent_moe_fusion imported deep_gemm'\n"
        "assert 'deepgemm' in {b.name for b in backends_for('routed_experts')}\n"
        "assert 'deepgemm' in {b.name for b in backends_for('moe_shared_producer')}\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_present_on_sm90_gives_grouped_gemms_only(monkeypatch):
    install(monkeypatch, FakeDeepGemm(), (9, 0))
    p = probe_deepgemm()
    assert p.available and p.apis == {SM90_GROUPED}
    assert p.arch == (9, 0) and p.version == "fake-2.6.1"
    assert "sm_10x" in p.reason  # says why MegaMoE is not offered


def test_present_on_sm100_gives_megamoe(monkeypatch):
    install(monkeypatch, FakeDeepGemm(), (10, 0))
    p = probe_deepgemm()
    assert p.available and p.apis == {SM100_MEGA}
    assert p.why_not(SM100_MEGA) is None and "unavailable" in p.why_not(SM90_GROUPED)


def test_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import fails as for a missing package
    monkeypatch.setattr(probe, "_device_capability", lambda: (9, 0))
    p = probe_deepgemm(refresh=True)
    assert not p.available and not p.apis
    assert "not installed" in p.reason


def test_wrong_signature_drops_only_that_group(monkeypatch):
    fake = FakeDeepGemm()

    def renamed(a, b, d, masked, expected_m, compiled_dims="nk"):  # `masked_m` renamed
        raise AssertionError("must not be called")

    fake.module.m_grouped_bf16_gemm_nt_masked = renamed
    install(monkeypatch, fake, (9, 0))
    p = probe_deepgemm()
    assert not p.available
    assert "m_grouped_bf16_gemm_nt_masked" in p.reason and "masked_m" in p.reason


def test_missing_function(monkeypatch):
    fake = FakeDeepGemm()
    del fake.module.fp8_fp4_mega_moe_bf16_shared_sp_rs  # an older fork without SP publication
    install(monkeypatch, fake, (10, 0))
    p = probe_deepgemm()
    assert not p.has(SM100_MEGA) and "fp8_fp4_mega_moe_bf16_shared_sp_rs is missing" in p.reason


@pytest.mark.parametrize("arch", [(8, 0), (12, 0)])
def test_wrong_arch_does_not_import(monkeypatch, arch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # importing would fail: the probe must not try
    monkeypatch.setattr(probe, "_device_capability", lambda: arch)
    p = probe_deepgemm(refresh=True)
    assert not p.available and f"sm_{arch[0]}{arch[1]}" in p.reason and "import" not in p.reason


def test_no_cuda_device(monkeypatch):
    monkeypatch.setattr(probe, "_device_capability", lambda: None)
    p = probe_deepgemm(refresh=True)
    assert not p.available and p.reason.startswith("no CUDA device")


def test_pybind_docstring_signature():
    class Builtin:
        __signature__ = "not a signature"  # inspect.signature raises, like on a pybind11 builtin
        __doc__ = ("m_grouped_bf16_gemm_nt_masked(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, "
                   "masked_m: torch.Tensor, expected_m: int, compiled_dims: str = 'nk') -> None\n")

        def __call__(self, *args):
            return None

    assert parameter_names(Builtin()) == ("a", "b", "d", "masked_m", "expected_m", "compiled_dims")

    class Unnamed(Builtin):
        __doc__ = "f(arg0: torch.Tensor, arg1: int) -> None"

    assert parameter_names(Unnamed()) is None  # bound without names: keywords would fail


def _routed_args(m=6, e=4, latent=64, inter=64, k=3):
    z = torch.randn(m, latent, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e + 2)[:k] - 2 for _ in range(m)]).clamp_min(-1).to(torch.int32)
    w = torch.rand(m, k)
    w13, s13 = quantize_mxfp4(torch.randn(e, 2 * inter, latent) * 0.1)
    w2, s2 = quantize_mxfp4(torch.randn(e, latent, inter) * 0.1)
    return (z, ids, w, w13, w2, s13, s2, "mxfp4", 4.0, 25.0)


def test_absent_falls_back_identically_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)
    monkeypatch.setattr(probe, "_device_capability", lambda: (9, 0))
    monkeypatch.setenv("LMF_BACKEND_ROUTED_EXPERTS", "deepgemm")
    args = _routed_args()
    rows = dict(explain("routed_experts", "cuda", *args))
    assert "not installed" in rows["deepgemm"]
    status = deepgemm.deepgemm_status()
    assert "not installed" in status and "Triton/reference" in status
    # Forcing the absent backend names why it cannot run.
    from latent_moe_fusion.ops.common.backends import select_backend

    with pytest.raises(RuntimeError, match="not installed"):
        select_backend("routed_experts", "cuda", *args)
    # Not forced: every rank (all see the same absence) picks the next backend, which computes
    # exactly what it computes without DeepGEMM installed.
    monkeypatch.delenv("LMF_BACKEND_ROUTED_EXPERTS")
    chosen = select_backend("routed_experts", "cuda", *args)
    assert chosen.name != "deepgemm"
    fallback = select_backend("routed_experts", "cpu", *args)
    assert fallback.name == "reference" and torch.equal(fallback.fn(*args), routed_experts_math(*args))
