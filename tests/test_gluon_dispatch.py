"""When the routed GEMMs may take the Gluon register-dequant kernels: the reasons regs_path_reason
gives (checked without a GPU) and the switch that turns the path off."""

import pytest
import torch

from latent_moe_fusion.ops.gluon_kernels import ENV_SWITCH, regs_path_reason
from latent_moe_fusion.ops.mxfp4 import quantize_mxfp4


def _weights(e=2, latent=256, inter=128):
    w13, s13 = quantize_mxfp4(torch.randn(e, 2 * inter, latent))
    w2, s2 = quantize_mxfp4(torch.randn(e, latent, inter))
    return w13, s13, w2, s2


def test_reasons_without_a_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    w13, s13, w2, s2 = _weights()
    z = torch.randn(3, 256, dtype=torch.bfloat16)
    assert "sm_90" in regs_path_reason(z, w13, w2, s13, s2, "mxfp4", 16)
    assert "MXFP4" in regs_path_reason(z, w13, w2, None, None, "bf16", 16)
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert ENV_SWITCH in regs_path_reason(z, w13, w2, s13, s2, "mxfp4", 16)
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" in regs_path_reason(z, w13, w2, s13, s2, "mxfp4", 16)


def test_shared_strategy_by_tokens_and_override(monkeypatch):
    from latent_moe_fusion.ops.triton_kernels import expert_schedule as es

    monkeypatch.delenv(es.SHARED_ENV, raising=False)
    assert es.shared_strategy(1) == es.shared_strategy(es.SHARED_SIDE_MAX_TOKENS) == "side"
    assert es.shared_strategy(es.SHARED_SIDE_MAX_TOKENS + 1) == "cublas"
    monkeypatch.setenv(es.SHARED_ENV, "cublas_side")
    assert es.shared_strategy(1) == "cublas_side"
    monkeypatch.setenv(es.SHARED_ENV, "overlap")
    with pytest.raises(ValueError, match="LMF_REGS_SHARED='overlap'.*side, cublas, cublas_side"):
        es.shared_strategy(1)


def test_shared_expert_by_library_gemms_matches_the_reference():
    """The cublas strategy's math (run here on CPU): the unfused block's shared expert, into shared.out."""
    from latent_moe_fusion.ops.math import shared_expert_math
    from latent_moe_fusion.ops.triton_kernels.expert_schedule import SharedExpert, _shared_by_cublas
    from tests.expert_problems import BETA, LIN_BETA, make_problem, rel_l2, tolerance

    p = make_problem(5, latent=64, inter=64, num_experts=2, top_k=2, hidden=256, inter_s=96)
    out = torch.full_like(p.x_s, float("nan"))
    _shared_by_cublas(SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, out), BETA, LIN_BETA)
    ref = shared_expert_math(p.x_s, p.w1_s, p.w3_s, p.w2_s, BETA, LIN_BETA)
    assert rel_l2(out, ref) < tolerance(torch.bfloat16)
