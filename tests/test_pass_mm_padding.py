"""Matmuls that Inductor's pad_mm padded (it did so on the H200 for the shared down-projection's rows at
M = 4) are fused like plain ones; padded matmuls outside the block keep their padding.

pad_mm only runs on GPUs, so these models write the padded forms themselves: constant_pad_nd of the
operands (rows M, inner K, columns N), mm, slices back to the real size — the post-grad shape pad_mm
leaves behind."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import latent_moe_fusion as lmf
from latent_moe_fusion.model.layers import situ_activation
from tests.fusion_models import CFG, TAIL, compiled, post_grad, producers, rel_l2

BF16 = torch.bfloat16
PAD_ROWS = 5


def _row_padded_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a @ w^T computed on rows padded with zeros, then sliced back (pad_mm's form)."""
    return torch.mm(F.pad(a, (0, 0, 0, PAD_ROWS)), w.t())[: a.shape[0]]


def _fully_padded_mm(a: torch.Tensor, w: torch.Tensor, mp: int = 3, kp: int = 6, np_: int = 5) -> torch.Tensor:
    """pad_mm's full form: a [M, K] padded to [M + mp, K + kp], b = w^T [K, N] to [K + kp, N + np_],
    the product sliced back to [M, N] (rows first, then columns)."""
    out = torch.mm(F.pad(a, (0, kp, 0, mp)), F.pad(w.t(), (0, np_, 0, kp)))
    return out[: a.shape[0], :][:, : w.shape[0]]


class FullyPaddedShared(lmf.KimiK3MoEBlock):
    """Both shared matmuls in pad_mm's full form (rows, K and columns padded)."""

    def shared(self, x_s: torch.Tensor) -> torch.Tensor:
        g, u = _fully_padded_mm(x_s, self.shared_w13).chunk(2, dim=-1)
        act = situ_activation(g, u, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return _fully_padded_mm(act, self.shared_w2, mp=0, kp=2, np_=0)  # K only: no slice at all


class PaddedSharedDown(lmf.KimiK3MoEBlock):
    def shared(self, x_s: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(x_s, self.shared_w13).chunk(2, dim=-1)
        act = situ_activation(g, u, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return _row_padded_mm(act, self.shared_w2)


class PaddedEverywhere(PaddedSharedDown):
    """Every matmul of the rewritten part padded (shared gate/up and down, up-projection), and an extra
    matmul after the block (outside: stays padded)."""

    def shared(self, x_s: torch.Tensor) -> torch.Tensor:
        g, u = _row_padded_mm(x_s, self.shared_w13).chunk(2, dim=-1)
        act = situ_activation(g, u, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return _row_padded_mm(act, self.shared_w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.routed(x)
        y_n = F.rms_norm(y, (y.shape[-1],), self.norm_weight, self.cfg.rms_norm_eps)
        out = _row_padded_mm(y_n, self.w_up) + self.shared(x)
        return _fully_padded_mm(out, self.w_after)  # outside the block: rebuilt as it was


def _plain_block_ops(x) -> Counter:
    """Ops of the same block, written without padding, after the pass."""
    fusion_pass = lmf.LatentMoEFusionPass()
    post_grad(lmf.KimiK3MoEBlock(CFG, dtype=BF16), (x,), fusion_pass)
    assert fusion_pass.report.matched == 1
    return fusion_pass.report.ops_after


def _fused_like_the_plain_block(model, tokens: int, padded: int, extra: Counter | None = None):
    """Compile `model` with the pass and check: one block fused, `padded` padded matmuls taken unpadded,
    the graph's ops those of the plain block (+ `extra`), numerics against eager. Returns the report."""
    x = torch.randn(tokens, CFG.hidden_size, dtype=BF16)
    fusion_pass = lmf.LatentMoEFusionPass()
    out = compiled(model, fusion_pass)(x)
    report = fusion_pass.report
    assert report.matched == 1, report.summary()
    assert report.unpadded_matmuls == padded
    assert report.ops_after == _plain_block_ops(x) + (extra or Counter())
    assert rel_l2(out, model(x)) < 1e-2
    return report


def test_row_padded_shared_down_projection_is_fused(rng_seed):
    report = _fused_like_the_plain_block(PaddedSharedDown(CFG, dtype=BF16, seed=rng_seed % 1000), 3, padded=1)
    assert "1 padded matmul(s) fused" in report.summary()
    assert producers(report.ops_after) == 1 and report.ops_after[TAIL] == 1


def test_k_and_column_padding_are_fused_too(rng_seed):
    _fused_like_the_plain_block(FullyPaddedShared(CFG, dtype=BF16, seed=rng_seed % 1000), 3, padded=2)


def test_padding_outside_the_block_is_restored(rng_seed):
    model = PaddedEverywhere(CFG, dtype=BF16, seed=rng_seed % 1000)
    model.w_after = torch.nn.Parameter(torch.randn(CFG.hidden_size, CFG.hidden_size, dtype=BF16) * 0.05,
                                       requires_grad=False)
    # the matmul after the block keeps its padded form: two pads, its mm, two slices (and w_after's permute);
    # the rebuilt chain must also compile and compute
    extra = Counter({"aten.constant_pad_nd.default": 2, "aten.mm.default": 1, "aten.slice.Tensor": 2,
                     "aten.permute.default": 1})
    _fused_like_the_plain_block(model, 2, padded=3, extra=extra)  # shared gate/up and down, up-projection


def test_a_rejected_block_keeps_its_padding(monkeypatch):
    monkeypatch.setenv("LMF_DISABLE_FUSION", "1")
    model = PaddedSharedDown(CFG, dtype=BF16)
    x = torch.randn(3, CFG.hidden_size, dtype=BF16)
    fusion_pass = lmf.LatentMoEFusionPass()
    post_grad(model, (x,), fusion_pass)
    report = fusion_pass.report
    assert report.matched == 0 and report.unpadded_matmuls == 0
    assert report.ops_after == report.ops_before  # graph exactly as it came


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
def test_kimi_block_is_fused_at_every_small_decode_size(m):
    """On a GPU pad_mm really runs (and benchmarks); the block must be fused whatever it pads."""
    cfg = lmf.KimiK3MoEConfig().replace(shared_intermediate_size=768)
    model = lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=BF16, device="cuda", ep_size=8, router_gemm="bf16")
    fusion_pass = lmf.LatentMoEFusionPass()
    post_grad(model, (torch.randn(m, cfg.hidden_size, dtype=BF16, device="cuda"),), fusion_pass)
    assert fusion_pass.report.matched == 1, fusion_pass.report.summary()
    print(f"M = {m}: {fusion_pass.report.unpadded_matmuls} padded matmul(s) fused")
