"""When the routed GEMMs may take the Gluon register-dequant kernels: the reasons regs_path_reason
gives (checked without a GPU) and the switch that turns the path off."""

import pytest
import torch

from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4
from latent_moe_fusion.ops.routed.gluon import REGS_OVERRIDE, regs_path_reason


def _weights(e=2, latent=256, inter=128):
    w13, s13 = quantize_mxfp4(torch.randn(e, 2 * inter, latent))
    w2, s2 = quantize_mxfp4(torch.randn(e, latent, inter))
    return w13, s13, w2, s2


def test_reasons_without_a_gpu(monkeypatch, tuned):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w13, s13, w2, s2 = _weights()
    z = torch.randn(3, 256, dtype=torch.bfloat16)
    assert "sm_90" in regs_path_reason(z, w13, w2, s13, s2, "mxfp4", 16)
    assert "MXFP4" in regs_path_reason(z, w13, w2, None, None, "bf16", 16)
    tuned(mxfp4_regs=False)
    assert f"{REGS_OVERRIDE}=False" in regs_path_reason(z, w13, w2, s13, s2, "mxfp4", 16)
    tuned(mxfp4_regs=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" in regs_path_reason(z, w13, w2, s13, s2, "mxfp4", 16)


def test_shared_strategy_by_tokens_and_override(tuned):
    from latent_moe_fusion.ops.routed import schedule_rules as es

    assert es.shared_strategy(1) == es.shared_strategy(es.SHARED_SIDE_MAX_TOKENS) == "side"
    assert es.shared_strategy(es.SHARED_SIDE_MAX_TOKENS + 1) == "cublas_side"
    assert es.shared_strategy(es.SHARED_CUBLAS_SIDE_MAX_TOKENS) == "cublas_side"
    assert es.shared_strategy(es.SHARED_CUBLAS_SIDE_MAX_TOKENS + 1) == "cublas"
    tuned(regs_shared="cublas_side")
    assert es.shared_strategy(1) == "cublas_side"
    tuned(regs_shared="side")
    assert es.shared_strategy(500) == "side"
    with pytest.raises(ValueError, match="regs_shared='overlap'.*side, cublas, cublas_side"):
        tuned(regs_shared="overlap")


def test_k_slices_must_be_whole_steps():
    from latent_moe_fusion.ops.routed.gluon import STEP_K, split_reason

    assert split_reason((2, 2), 3584, 3072) is None
    assert split_reason((7, 3), 3584, 3072) is None  # 28 and 24 steps of 128
    assert f"L1 K = 3584 does not cut into 3 slices of whole {STEP_K}" in split_reason((3, 1), 3584, 3072)
    assert "L2 K = 3072 does not cut into 5 slices" in split_reason((1, 5), 3584, 3072)


def test_merged_gate_up_views_are_found_adjacent():
    from latent_moe_fusion.ops.routed.shared_by_library import merged_rows

    w13 = torch.randn(2 * 48, 64, dtype=torch.bfloat16)
    g, u = w13[:48], w13[48:]
    assert torch.equal(merged_rows(g, u), w13)
    assert merged_rows(u, g) is None  # up before gate: not the [gate; up] order
    assert merged_rows(w13[:40], w13[48:88]) is None  # a gap between the blocks
    assert merged_rows(g.clone(), u.clone()) is None  # two storages
    assert merged_rows(w13[:, :32], w13[:, 32:]) is None  # column blocks
    assert merged_rows(g, u.float()) is None


@pytest.mark.parametrize("merged", [True, False])
def test_shared_expert_by_library_with_merged_or_separate_gate_up(merged):
    from latent_moe_fusion.ops.common.reference_math import shared_expert_math
    from latent_moe_fusion.ops.routed.shared_by_library import shared_by_library
    from tests.expert_problems import BETA, LIN_BETA, make_problem, rel_l2, tolerance

    p = make_problem(6, latent=64, inter=64, num_experts=2, top_k=2, hidden=256, inter_s=96)
    w1_s, w3_s = p.w1_s, p.w3_s
    if merged:
        w13 = torch.cat([w1_s, w3_s])
        w1_s, w3_s = w13[:96], w13[96:]
    out = torch.full_like(p.x_s, float("nan"))
    shared_by_library(p.x_s, w1_s, w3_s, p.w2_s, out, BETA, LIN_BETA)
    ref = shared_expert_math(p.x_s, p.w1_s, p.w3_s, p.w2_s, BETA, LIN_BETA)
    assert rel_l2(out, ref) < tolerance(torch.bfloat16)


def test_weight_rings_by_pairs_and_by_override(tuned):
    """The measured ring choice (L2 leaves the TMA ring past L2_TMA_MAX_PAIRS), the override in one or two
    names, and the loads where a ring cannot run: K ranges short of whole rounds, K slices."""
    from latent_moe_fusion.ops.routed.gluon import L2_TMA_MAX_PAIRS, ring_for, weight_rings

    assert weight_rings(128) == ("tma", "tma")
    assert weight_rings(L2_TMA_MAX_PAIRS + 1) == ("tma", "cp4")
    assert weight_rings(L2_TMA_MAX_PAIRS + 1, 64) == weight_rings(65536, 64) == ("tma", "tma")  # 64-row blocks
    tuned(mxfp4_ring="cp2")
    assert weight_rings(65536, 64) == ("cp2", "cp2")
    assert weight_rings(128) == ("cp2", "cp2")
    tuned(mxfp4_ring="loads,cp4")
    assert weight_rings(4096) == ("loads", "cp4")
    assert ring_for("tma", 28, 1) == "tma" and ring_for("cp2", 14, 1) == "cp2"
    assert ring_for("tma", 14, 1) == "loads" and ring_for("cp4", 7, 1) == "loads"
    assert ring_for("tma", 28, 2) == "loads"  # K slices take the loads


@pytest.mark.parametrize("value", ["tma,cp4,loads", "fast", "tma,", "4"])
def test_a_bad_ring_override_says_what_it_takes(value, tuned):
    from latent_moe_fusion.ops.routed.gluon import RING_OVERRIDE, ring_for

    with pytest.raises(ValueError, match=f"{RING_OVERRIDE}=.*expected one of loads, cp2, cp4, tma"):
        tuned(mxfp4_ring=value)
    with pytest.raises(ValueError, match="unknown weight ring 'fast'"):
        ring_for("fast", 28, 1)


@pytest.mark.parametrize("value", ["soon", "Late", "early,late"])
def test_a_bad_load_order_says_what_it_takes(value, tuned):
    from latent_moe_fusion.ops.routed.gluon import LOAD_ORDER_OVERRIDE

    with pytest.raises(ValueError, match=f"{LOAD_ORDER_OVERRIDE}=.*expected one of auto, early, late"):
        tuned(mxfp4_load_order=value)


def test_the_load_order_defaults_to_auto(tuned):
    from latent_moe_fusion.ops.routed.gluon import load_order

    assert load_order() == "auto"
    tuned(mxfp4_load_order="late")
    assert load_order() == "late"


def test_the_kernel_modules_leave_the_package_functions_alone():
    """Importing the kernels (what a launch does) must not shadow a package function with a submodule of
    the same name (a GPU-only failure otherwise: the launchers import them lazily)."""
    import latent_moe_fusion.ops.routed.gluon as gk
    from latent_moe_fusion.ops.routed.gluon import gluon_routed_gemv, ring_loops, routed_gemm  # noqa: F401

    for name in ("weight_rings", "ring_for", "default_rings", "max_registers", "regs_path_reason", "split_reason", "load_order",
                 "launch_routed_l1", "launch_routed_l2"):
        assert callable(getattr(gk, name)), name


@pytest.mark.parametrize("value", ["12", "12,auto", "300,80", "auto,many", "128,80,64", "128,"])
def test_a_bad_register_cap_says_what_it_takes(value, tuned):
    from latent_moe_fusion.ops.routed.gluon import MAXNREG_OVERRIDE

    with pytest.raises(ValueError, match=f"{MAXNREG_OVERRIDE}=.*expected L1,L2"):
        tuned(mxfp4_maxnreg=value)


def test_the_register_caps_follow_the_override(tuned):
    from latent_moe_fusion.ops.routed.gluon import L1_MAX_REGISTERS, L2_MAX_REGISTERS, max_registers

    assert (max_registers("l1", "tma"), max_registers("l1", "cp"), max_registers("l2", "tma")) == (
        None, L1_MAX_REGISTERS, L2_MAX_REGISTERS)
    assert [max_registers(k, r, 64) for k in ("l1", "l2") for r in ("tma", "cp", "loads")] == [None] * 6  # 64 rows
    tuned(mxfp4_maxnreg="128,none")
    assert (max_registers("l1", "tma", 64), max_registers("l2", "cp", 64)) == (128, None)  # the override wins
    assert (max_registers("l1", "tma"), max_registers("l2", "cp")) == (128, None)
    tuned(mxfp4_maxnreg="none")
    assert (max_registers("l1", "cp"), max_registers("l2", "tma")) == (None, None)
    tuned(mxfp4_maxnreg="auto,96")
    assert (max_registers("l1", "tma"), max_registers("l1", "loads"), max_registers("l2", "tma")) == (
        None, L1_MAX_REGISTERS, 96)


def test_128_row_blocks_refuse_k_slices_and_dependent_launches():
    """The staged kernels run whole K as ordinary launches: the launchers say so before anything launches."""
    from latent_moe_fusion.ops.routed.gluon import STAGED_BLOCK_ROWS, launch_routed_l1, launch_routed_l2

    w13, s13, w2, s2 = _weights()
    z = torch.randn(3, 256, dtype=torch.bfloat16)
    ids = torch.zeros(STAGED_BLOCK_ROWS, dtype=torch.int32)
    experts = torch.zeros(1, dtype=torch.int32)
    act = torch.empty(STAGED_BLOCK_ROWS, 128, dtype=torch.bfloat16)
    for kwargs in ({"split": 2}, {"signal": True}):
        with pytest.raises(ValueError, match="128-row blocks run whole K without programmatic dependents"):
            launch_routed_l1(z, w13, s13, ids, experts, act, 1, STAGED_BLOCK_ROWS, 16, 4.0, 25.0, **kwargs)
    pairs = torch.empty(3 * 16, 256)
    with pytest.raises(ValueError, match="128-row blocks run whole K as an ordinary launch"):
        launch_routed_l2(act, w2, s2, ids, experts, pairs, 1, STAGED_BLOCK_ROWS, dependent=True)
    with pytest.raises(ValueError, match="128-row blocks run whole K as an ordinary launch"):
        launch_routed_l2(act, w2, s2, ids, experts, pairs.view(2, 24, 256), 1, STAGED_BLOCK_ROWS)
