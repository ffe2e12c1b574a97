"""Where run_experts launches the shared expert's in-line library GEMMs (CPU, TRITON_INTERPRET=1): before the routed
grouping at prefill sizes, right after the routed L1 at decode sizes, either by the override; the same outputs bit
for bit (the same kernels on one stream), and a clear error for an unknown override."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion import tuning
from latent_moe_fusion.ops.routed import expert_schedule
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from latent_moe_fusion.ops.routed.schedule_rules import GRID_SHARED_MAX_TOKENS, in_line_library_first
from tests.expert_problems import EPS, make_problem, rel_l2, tolerance

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU wiring test (the GPU runs the block tests)")

SIZES = dict(latent=64, inter=32, num_experts=4, top_k=2, hidden=64, inter_s=32)
M = GRID_SHARED_MAX_TOKENS + 8  # beyond it the producer's shared expert runs as library GEMMs


def test_the_order_by_size_and_override(tuned):
    assert in_line_library_first(GRID_SHARED_MAX_TOKENS + 1) and in_line_library_first(4096)
    assert not in_line_library_first(128) and not in_line_library_first(GRID_SHARED_MAX_TOKENS)
    tuned(shared_in_line="after_l1")
    assert not in_line_library_first(4096)
    tuned(shared_in_line="first")
    assert in_line_library_first(32)
    with pytest.raises(ValueError, match="shared_in_line='early'.*first.*after_l1"):
        tuned(shared_in_line="early")


def _run_recording(p, monkeypatch, order: str) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """run_experts with the shared expert, recording the launch order of the library GEMMs, the grouping and L1."""
    calls: list[str] = []

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(expert_schedule, "shared_by_library", recorded("shared", expert_schedule.shared_by_library))
    monkeypatch.setattr(expert_schedule, "group_by_expert", recorded("grouping", expert_schedule.group_by_expert))
    monkeypatch.setattr(expert_schedule, "l1_kernel", _Recorded(expert_schedule.l1_kernel, calls))
    s_out = torch.full_like(p.x_s, float("nan"))
    with tuning.overrides(shared_in_line=order):
        y = run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=EPS,
                        shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out))
    monkeypatch.undo()
    return calls, y, s_out


class _Recorded:
    """A Triton kernel whose launches (kernel[grid](...)) are recorded as "l1"."""

    def __init__(self, kernel, calls: list[str]) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append("l1")
        return self.kernel[grid]


def test_library_gemms_go_first_at_prefill_sizes_with_the_same_bits(monkeypatch, rng_seed):
    p = make_problem(M, weight_format="mxfp4", **SIZES)
    first, y_first, s_first = _run_recording(p, monkeypatch, "first")
    after, y_after, s_after = _run_recording(p, monkeypatch, "after_l1")
    assert first == ["shared", "grouping", "l1"]
    assert after == ["grouping", "l1", "shared"]
    assert torch.equal(y_first, y_after) and torch.equal(s_first, s_after)
    y_ref, s_ref = p.reference_producer()
    assert rel_l2(y_first, y_ref) < tolerance(torch.bfloat16) and rel_l2(s_first, s_ref) < tolerance(torch.bfloat16)
