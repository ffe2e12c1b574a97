"""The Gluon register-dequant kernels compile for sm_90 on this CPU machine, and their main loop is what
the design says: wgmma with the dequantised weight from registers (no shared-memory load in the loop,
and shared-memory stores only for the activation tile), 16-byte weight loads, and L1 within 128
registers (4 CTAs of 4 warps per SM); the weight rings (cp.async or TMA through shared-memory stages)
take one CTA barrier per step and spill nothing under the register caps. The layout conversion to the
wgmma operand is compiled with assert_trivial, so a change that needs a shuffle fails to compile here.

Runs tests/gluon_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET (which these tests set)."""

import json
from pathlib import Path

from latent_moe_fusion.ops.common.triton_compat import offline_budget
from latent_moe_fusion.ops.routed.gluon import L1_MAX_REGISTERS, L2_MAX_REGISTERS, WEIGHT_RINGS
from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent


def test_register_dequant_kernels_compile_for_sm90_with_register_operands(tmp_path):
    done = run_compiled([str(ROOT / "tests" / "gluon_compile_sm90.py"), "--out", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "gluon_sass.json").read_text())
    # 32-row blocks (M = 128): L1's TMA ring issuing the next step's loads late (the "auto" order there) fits
    # 3 CTAs of 4 warps per SM, where the early order takes 177 registers (2 CTAs); L2's TMA ring spills nothing
    wide = {(r["kernel"], r["ring"], r["order"]): r for r in rows if r["block_rows"] == 32}
    assert sorted(wide) == [("l1_regs_kernel", "tma", "early"), ("l1_regs_kernel", "tma", "late"),
                            ("l2_regs_kernel", "tma", "auto")], sorted(wide)
    assert wide["l1_regs_kernel", "tma", "late"]["registers"] <= 168 and wide["l1_regs_kernel", "tma", "late"]["spills"] == 0
    assert wide["l2_regs_kernel", "tma", "auto"]["registers"] <= L2_MAX_REGISTERS
    assert wide["l2_regs_kernel", "tma", "auto"]["spills"] == 0
    rows = [r for r in rows if r["block_rows"] == 16]
    # both kernels, whole K and cut into 2 slices (the single-token split), for every weight ring
    assert sorted((r["kernel"], r["ring"], r["k_slices"]) for r in rows) == sorted(
        (f"{w}_regs_kernel", ring, split) for w in ("l1", "l2") for ring in WEIGHT_RINGS
        for split in ((1, 2) if ring == "loads" else (1,))), rows
    for r in rows:
        l1 = r["kernel"] == "l1_regs_kernel"
        name = f"{r['kernel']} ({r['ring']}, {r['k_slices']} K slices)"
        # per 128-k step: 8 wgmma (k 16 each) per weight tile; L1 has a gate and an up tile
        assert r["HGMMA"] == (16 if l1 else 8), r
        assert r["registers"] <= (L1_MAX_REGISTERS if l1 else L2_MAX_REGISTERS), r  # 4 / 3 CTAs per SM
        # what decode runs: L1 and L2 on their TMA rings (L2 under its cap of 80 for 3 CTAs per SM), the
        # cp.async ring beyond L2_TMA_MAX_PAIRS, the loads where a ring cannot run: none spills
        if r["k_slices"] == 1:
            assert r["spills"] == 0, f"{name} spills registers: {r}"
        act_stores = 16 * 128 * 2 // (r["warps"] * 32) // 4  # activation tile in 4-byte stores at most
        assert 0 < r["STS"] <= act_stores, f"{name}: {r['STS']} shared stores per step: {r['top']}"
        if r["ring"] == "loads":
            assert r["LDS"] == 0, f"{name}: shared-memory loads in the loop (weight staged?): {r['top']}"
            assert r["LDG_128"] >= (2 if l1 else 1) * 2, f"{name}: weight words not in 16-byte loads: {r}"
        else:
            # the rings' promise: only the activation tile's CTA barriers (the TMA ring's single buffer takes
            # two per step, the cp.async ring's double buffer one), the weight words read back in 16-byte loads
            assert r["BAR"] == (offline_budget("regs_tma_barriers_per_step", 2) if r["ring"] == "tma" else 1), \
                f"{name}: {r['BAR']} barriers per step: {r['top']}"
            if r["ring"] == "tma":  # the single buffer's point: L1's loop under 390 instructions (415 with two)
                assert r["loop_instr"] < (390 if l1 else offline_budget("regs_l2_loop_instructions", 225)), r
            assert r["LDS"] >= (2 if l1 else 1) * 2, r
            copies = r["UTMALDG"] if r["ring"] == "tma" else r["LDGSTS"] / ((2 if l1 else 1) * 2)
            assert copies == 1, f"{name}: {r}"
