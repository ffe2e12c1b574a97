"""The staged prefill kernels (ops/routed/gluon/routed_staged.py) compile for sm_90 on this CPU machine and their k loop
is what the design says: per 64-wide k step one CTA barrier, 4 asynchronous wgmma from shared memory with a wait that
leaves the newest in flight (the tensor cores run step i while the threads dequantise step i + 1), the 128 activation
rows by 4 cp.async copies per thread (no activation registers), the weight words by one TMA copy, the dequantised tile
by 4 16-byte stores; and the launch fits 2 CTAs of 8 warps per SM (128 registers without spills, shared memory within
half an SM's 228 KB). The gate / up pairing of L1's epilogue is compiled with assert_trivial.

Runs tests/staged_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET (which these tests set)."""

import json
from pathlib import Path

from latent_moe_fusion.ops.common.triton_compat import offline_budget
from latent_moe_fusion.ops.routed.gluon import STAGED_MAX_REGISTERS, STAGED_WARPS
from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent
SM_SHARED_BYTES, CTA_RESERVED_BYTES = 228 * 1024, 1024  # sm_90: shared memory per SM, reserved per CTA


def test_staged_kernels_compile_for_sm90_with_two_ctas_per_sm(tmp_path):
    done = run_compiled([str(ROOT / "tests" / "staged_compile_sm90.py"), "--out", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["kernel"]: r for r in json.loads((tmp_path / "staged_sass.json").read_text())}
    assert sorted(rows) == ["l1_staged_kernel", "l2_staged_kernel"]
    for name, r in rows.items():
        assert r["spills"] <= offline_budget("staged_spills", 0) and r["registers"] <= STAGED_MAX_REGISTERS, r
        assert 2 * r["registers"] * 32 * STAGED_WARPS <= 65536, r  # two CTAs' registers
        assert 2 * (r["shared_bytes"] + CTA_RESERVED_BYTES) <= SM_SHARED_BYTES, r  # two CTAs' shared memory
        assert r["BAR"] == offline_budget("staged_barriers_per_step", 1) and r["HGMMA"] == 4, f"{name}: {r['BAR']} barriers, {r['HGMMA']} wgmma per step: {r}"
        assert r["LDGSTS"] == 4 and r["UTMALDG"] == 1, f"{name}: activation / weight copies per step: {r}"
        assert r["STS"] == r["STS_128"] == 4, f"{name}: the dequantised tile not in 4 16-byte stores: {r}"
        assert r["LDS"] <= 8 and r["HMUL2"] == 16, r  # one 16-byte read of 4 words (+ nops), 4 words dequantised
        assert r["wgmma_waits_one_left"] >= 8, f"{name}: the loop waits for every wgmma (no overlap): {r}"
