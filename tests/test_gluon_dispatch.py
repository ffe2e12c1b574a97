"""When the routed GEMMs may take the Gluon register-dequant kernels: the reasons regs_path_reason
gives (checked without a GPU) and the switch that turns the path off."""

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
