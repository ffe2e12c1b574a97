"""torch 2.11 leaves the scalar pattern arguments (eps, beta, lin_beta) out of Match.kwargs when
extra_check runs (seen on the H200 image: every block was then left unfused). Simulate that on any
torch version and check the pass still fuses the block."""

import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import matcher
from latent_moe_fusion.patterns.spec import SCALAR_EXAMPLES


def test_block_is_fused_when_match_kwargs_lack_the_scalars(monkeypatch):
    original = matcher._ops_refuse
    seen = []

    def without_scalars(spec, match):
        kept = match.kwargs
        match.kwargs = {k: v for k, v in kept.items() if k not in SCALAR_EXAMPLES}
        try:
            seen.append(sorted(match.kwargs))
            return original(spec, match)
        finally:
            match.kwargs = kept

    monkeypatch.setattr(matcher, "_ops_refuse", without_scalars)
    cfg = lmf.KimiK3MoEConfig.tiny()
    block = lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, seed=3)
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    x = torch.randn(5, cfg.hidden_size, dtype=torch.bfloat16)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(block, options={"post_grad_custom_pre_pass": fpass}, dynamic=False)(x)
    assert seen, "the gate never ran"
    assert fpass.report.matched == 1, fpass.report.rejected
    ref = block(x)
    assert float((out.double() - ref.double()).norm() / ref.double().norm()) <= 1e-2
