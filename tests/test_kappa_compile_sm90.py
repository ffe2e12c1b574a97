"""The kappa prefill kernels (ops/routed/gluon/routed_kappa.py) and the warp-specialised ones (routed_staged_ws.py)
compile for sm_90 on this CPU machine as their launchers compile them.

Kappa: two CTAs of 8 warps fit an SM (at most 128 registers without spills, shared memory within half an SM's
228 KB), and per 128-wide k step the loop does what the design says: 8 wgmma with the weights from registers, no
shared-memory stores (the dequantised weights never go there), each thread's two 16-byte weight fragments and two
scale bytes from global memory, one TMA copy of the activation tile, 32 bf16x2 multiplies (8 words dequantised).
Warp-specialised: one CTA per SM without spills, its partitions' register counts set (setmaxnreg). The Triton gather
of L1's rows (triton/kappa_columns.py): 16-byte loads and stores, no spills.

Runs tests/kappa_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET (which these tests set)."""

import json
from pathlib import Path

import pytest

from latent_moe_fusion.ops.common.triton_compat import offline_budget
from latent_moe_fusion.ops.routed.gluon import STAGED_MAX_REGISTERS
from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent
SM_SHARED_BYTES, CTA_RESERVED_BYTES = 228 * 1024, 1024  # sm_90: shared memory per SM, reserved per CTA


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("kappa_sass")
    done = run_compiled([str(ROOT / "tests" / "kappa_compile_sm90.py"), "--out", str(out)], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["kernel"]: r for r in json.loads((out / "kappa_sass.json").read_text())}


def test_kappa_kernels_fit_two_ctas_per_sm_and_keep_weights_out_of_shared_memory(rows):
    for name in ("l1_kappa_kernel", "l2_kappa_kernel"):
        r = rows[name]
        assert r["spills"] <= offline_budget("kappa_spills", 0) and r["registers"] <= STAGED_MAX_REGISTERS, r
        assert 2 * (r["shared_bytes"] + CTA_RESERVED_BYTES) <= SM_SHARED_BYTES, r  # two CTAs' shared memory
        # one k loop per MMA tier (N = 16, 32, 64, 64 + 16, 64 + 32, 128), the 64 + x tiers with two wgmma a chunk
        assert sorted(step["HGMMA"] for step in r["loops"]) == [8] * 4 + [16] * 2, f"{name}: wgmma per step: {r}"
        for step in r["loops"]:
            assert step["STS"] == 0 and step["LDL"] == 0, f"{name}: shared stores / spills in the k loop: {step}"
            assert step["LDG_128"] == 2 and step["LDG"] == 4 and step["UTMALDG"] == 1, f"{name}: loads: {step}"
            assert step["HMUL2"] == 32 and step["LDGSTS"] == 0, step
            assert step["BAR"] <= offline_budget("kappa_barriers_per_step", 3), step


def test_warp_specialised_kernels_fit_one_cta_per_sm_without_spills(rows):
    for name in ("l1_ws_kernel", "l2_ws_kernel"):
        r = rows[name]
        assert r["spills"] <= offline_budget("ws_spills", 0), r
        assert r["shared_bytes"] + CTA_RESERVED_BYTES <= SM_SHARED_BYTES, r
        assert r["setmaxnreg"] > 0, f"{name}: no per-partition register counts: {r}"


def test_kappa_gather_compiles_with_16_byte_loads_and_stores(rows):
    r = rows["gather_kappa_rows_kernel"]
    assert r["spills"] == 0, r
    assert r["LDG_128"] > 0 and r["STG_128"] > 0, f"the row chunks not moved in 16-byte pieces: {r}"
