"""The router's GEMM choice on CPU: a bad name says so; 'bf16' falls back to the FP32 GEMM off CUDA."""

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.model.router import route, router_logits


def test_bf16_router_falls_back_to_fp32_on_cpu(rng_seed):
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(router_logits(x, w, "bf16"), router_logits(x, w, "fp32"))
    bias = torch.randn(16)
    ids_bf16, weights_bf16 = route(x, w, bias, 4, 1.0, "bf16")
    ids_fp32, weights_fp32 = route(x, w, bias, 4, 1.0)
    assert torch.equal(ids_bf16, ids_fp32) and torch.equal(weights_bf16, weights_fp32)


def test_unknown_router_gemm_is_refused():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="router gemm must be one of"):
        router_logits(x, w, "tf32")
    with pytest.raises(ValueError, match="router_gemm must be one of"):
        lmf.KimiK3MoEBlock(lmf.KimiK3MoEConfig.tiny(), router_gemm="fp16")


def test_block_keeps_its_router_choice():
    block = lmf.KimiK3MoEBlock(lmf.KimiK3MoEConfig.tiny(), router_gemm="bf16")
    assert block.router_gemm == "bf16"
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(block(x), lmf.KimiK3MoEBlock(lmf.KimiK3MoEConfig.tiny())(x), rtol=0, atol=0)
