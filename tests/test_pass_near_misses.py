"""Blocks that nearly fit: each is left alone with the reason that is really the cause, pinned here."""

import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.model.layers import RMS_NORMS
from tests.fusion_models import CFG, block, post_grad

BF16 = torch.bfloat16


class _UpBias(lmf.KimiK3MoEBlock):
    """The up-projection with a bias: F.linear(y_n, w_up, b_up) becomes aten.addmm."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.b_up = torch.nn.Parameter(torch.randn(CFG.hidden_size, dtype=self.w_up.dtype), requires_grad=False)

    def forward(self, x):
        y_n = RMS_NORMS[self.rms_norm_form](self.routed(x), self.norm_weight, self.cfg.rms_norm_eps)
        return torch.nn.functional.linear(y_n, self.w_up, self.b_up) + self.shared(x)


class _SharedBias(lmf.KimiK3MoEBlock):
    """The shared down-projection with a bias."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.b_s = torch.nn.Parameter(torch.randn(CFG.hidden_size, dtype=self.w_up.dtype), requires_grad=False)

    def shared(self, x_s):
        from latent_moe_fusion.model.layers import situ_activation

        g, u = torch.nn.functional.linear(x_s, self.shared_w13).chunk(2, dim=-1)
        act = situ_activation(g, u, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return torch.nn.functional.linear(act, self.shared_w2, self.b_s)


def _rejected(model, options=None) -> list[str]:
    fusion = lmf.LatentMoEFusionPass()
    x = torch.randn(6, CFG.hidden_size, dtype=BF16)
    with torch._inductor.config.patch(options or {}), torch.no_grad():
        post_grad(model, (x,), fusion)
    assert fusion.report.matched == 0, fusion.report.summary()
    return [reason for _, reason in fusion.report.rejected]


def test_an_up_projection_bias_is_named_as_the_cause():
    (reason,) = _rejected(_UpBias(CFG, seed=1, dtype=BF16))
    assert "feeds addmm (aten.addmm.default), which adds a bias (F.linear with a bias)" in reason, reason
    assert "graph output" not in reason


def test_a_shared_down_projection_bias_is_named_as_the_cause():
    (reason,) = _rejected(_SharedBias(CFG, seed=2, dtype=BF16))
    assert reason.startswith("the shared expert's down-projection addmm") and "adds a bias" in reason, reason


def test_inductor_freezing_is_named_as_the_cause_on_cpu():
    """On CPU, freezing packs each linear's weight for oneDNN/MKL: no aten.mm is left to fuse."""
    (reason,) = _rejected(block(3, dtype=BF16), {"freezing": True})
    assert "prepacked weight (Inductor's freezing packs weights on CPU)" in reason, reason
    assert "compile without freezing to fuse" in reason and "graph output" not in reason
