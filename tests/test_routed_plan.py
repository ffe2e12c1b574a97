"""plan_routed agrees with the decision functions run_experts calls, and `plan` checks its arguments."""

import os
import subprocess
import sys

import pytest
import torch

from latent_moe_fusion.ops.routed import producer_config as pc
from latent_moe_fusion.ops.routed.routed_plan import plan_routed

MS = (1, 2, 4, 8, 32, 128, 512, 4096, 32768)
K3_RANK = dict(top_k=16, num_local_experts=112, latent=3584, inter=3072)


@pytest.fixture
def compiled(monkeypatch):
    """As on a GPU: pick_config's interpreter branch off (conftest sets TRITON_INTERPRET for the CPU tests)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pc.ROUTED_FP8_ENV, raising=False)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("cap", [(9, 0), (8, 0)])
def test_the_plan_follows_pick_config(compiled, m, cap):
    plan = plan_routed(m, capability=cap, **K3_RANK)
    picked = pc.pick_config(m * 16, "mxfp4", torch.bfloat16, 112, capability=cap)
    assert plan.num_pairs == m * 16
    assert plan.config.routed_gemv == picked.routed_gemv
    assert plan.config.routed_regs == picked.routed_regs
    assert plan.config.routed_fp8 == picked.routed_fp8  # L and I of K3 fit the FP8 rings: nothing dropped
    if plan.family != "gemv":
        assert plan.block_m == picked.bm
    if cap != (9, 0):
        assert plan.family == "triton" and not picked.routed_regs and not picked.routed_gemv
    assert all(d.reason for d in plan.decisions)


@pytest.mark.parametrize("m", MS)
def test_the_hopper_families_follow_the_decision_functions(compiled, m):
    pairs = m * 16
    plan = plan_routed(m, capability=(9, 0), **K3_RANK)
    if pc.routed_gemv_picked(pairs):
        assert plan.family == "gemv"
    elif pairs <= pc.DECODE_PAIRS:
        bm = pc.decode_block_m(pairs, 112)
        assert plan.family == ("regs_fp8" if bm == 16 else "regs")
        assert plan.k_splits == pc.regs_decode_split(pairs)
    else:
        rows = pc.prefill_regs_block_m(pairs, 112)
        assert plan.block_m == rows
        assert plan.family == ("staged" if rows == 128 else "regs")


def test_a_switched_off_regs_path_says_why(compiled):
    plan = plan_routed(32, capability=(9, 0), overrides={"mxfp4_regs": False}, **K3_RANK)
    assert plan.family == "triton"


def test_the_interpreter_is_named(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan = plan_routed(32, capability=None, **K3_RANK)
    assert plan.family == "triton" and "TRITON_INTERPRET" in dict((d.name, d.reason) for d in plan.decisions)["kernels"]


def test_the_command_prints_one_line_per_decision():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", pc.ROUTED_FP8_ENV)}
    done = subprocess.run([sys.executable, "-m", "latent_moe_fusion", "plan", "--m", "1"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names[:3] == ["pairs", "kernels", "grouping"]
    assert done.stdout.splitlines()[1].split()[1] == "gemv"
