"""The SiTU pass between DeepGEMM's grouped GEMMs (Triton; interpreted on the CPU)."""

import pytest
import torch

from latent_moe_fusion.ops.common.reference_math import situ
from latent_moe_fusion.ops.routed.situ_rows import situ_rows

BETA, LIN_BETA = 4.0, 25.0
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _expected(h: torch.Tensor) -> torch.Tensor:
    inter = h.shape[-1] // 2
    return situ(h[..., :inter], h[..., inter:], BETA, LIN_BETA).to(torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_all_rows():
    h = (torch.randn(5, 2 * 48, device=DEVICE) * 3).to(torch.bfloat16)
    assert _rel(situ_rows(h, BETA, LIN_BETA), _expected(h)) < 4e-3


def test_masked_groups_compute_only_their_tokens():
    h = (torch.randn(3, 4, 2 * 40, device=DEVICE) * 3).to(torch.bfloat16)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32, device=DEVICE)
    out = situ_rows(h, BETA, LIN_BETA, masked_counts=counts)
    ref = _expected(h)
    for g, c in enumerate(counts.tolist()):
        if c:
            assert _rel(out[g, :c], ref[g, :c]) < 4e-3


def test_contiguous_layout_skips_padding_rows():
    h = (torch.randn(6, 2 * 32, device=DEVICE) * 3).to(torch.bfloat16)
    layout = torch.tensor([0, 0, -1, 1, -1, 1], dtype=torch.int32, device=DEVICE)
    out = situ_rows(h, BETA, LIN_BETA, grouped_layout=layout)
    keep = layout >= 0
    assert _rel(out[keep], _expected(h)[keep]) < 4e-3


@pytest.mark.parametrize("bad", [torch.zeros(3, 7, dtype=torch.bfloat16), torch.zeros(3, 8)])
def test_rejects_odd_width_or_wrong_dtype(bad):
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        situ_rows(bad, BETA, LIN_BETA)


def test_cpu_tensors_outside_the_interpreter_fall_back_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h = (torch.randn(4, 2 * 16) * 3).to(torch.bfloat16)
    assert _rel(situ_rows(h, BETA, LIN_BETA), _expected(h)) < 4e-3


def test_pair_of_separate_operands_and_of_two_halves():
    from latent_moe_fusion.ops.routed.situ_rows import situ_pair

    g = (torch.randn(7, 40, device=DEVICE) * 3).to(torch.bfloat16)
    u = (torch.randn(7, 40, device=DEVICE) * 3).to(torch.bfloat16)
    expected = situ(g, u, BETA, LIN_BETA).to(torch.bfloat16)
    assert _rel(situ_pair(g, u, BETA, LIN_BETA), expected) < 4e-3
    h = torch.cat([g, u], dim=1)  # the halves of one [rows, 2I] GEMM output: row stride 2I
    out = situ_pair(h[:, :40], h[:, 40:], BETA, LIN_BETA)
    assert out.is_contiguous() and _rel(out, expected) < 4e-3


def test_pair_rejects_mismatched_operands():
    from latent_moe_fusion.ops.routed.situ_rows import situ_pair

    g = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one shape and one stride"):
        situ_pair(g, torch.randn(4, 16, dtype=torch.bfloat16)[:, :8], BETA, LIN_BETA)
    with pytest.raises(ValueError, match="bfloat16"):
        situ_pair(g.float(), g.float(), BETA, LIN_BETA)
