"""The W4A8 prefill kernels (ops/routed/gluon/routed_w4a8.py) compile for sm_90 on this CPU machine and their k loop is
what the design says: per 128-wide k step one CTA barrier, 8 FP8 wgmma (two [128 x 64 x 128] MMAs) left in flight
while the next step's weights are expanded, the 128 activation rows by 4 cp.async copies per thread, the weight words
by one TMA copy, the expanded tile by 4 16-byte stores, 8 words of 8 codes expanded by table lookups (4 prmt each,
no conversions), 64 FFMA promotions (a thread's two accumulators); one CTA of 8 warps per SM fits (registers, shared memory).

Runs tests/w4a8_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET (which these tests set)."""

import json
from pathlib import Path

from latent_moe_fusion.ops.common.triton_compat import offline_budget
from latent_moe_fusion.ops.routed.w4a8_path import W4A8_ROWS, W4A8_WARPS
from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent
SM_SHARED_BYTES, CTA_RESERVED_BYTES = 228 * 1024, 1024  # sm_90: shared memory per SM, reserved per CTA


def test_w4a8_kernels_compile_for_sm90_with_the_designed_k_loop(tmp_path):
    done = run_compiled([str(ROOT / "tests" / "w4a8_compile_sm90.py"), "--out", str(tmp_path)], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "w4a8_sass.json").read_text())
    assert sorted((r["kernel"], r["rows"]) for r in rows) == [(k, n) for k in ("l1_w4a8_kernel", "l2_w4a8_kernel")
                                                              for n in W4A8_ROWS]
    for r in rows:
        name, n = f"{r['kernel']} ({r['rows']} rows)", r["rows"]
        ctas = 2 if n == 64 else 1
        assert ctas * r["registers"] * 32 * W4A8_WARPS <= 65536, r
        assert r["spills"] <= offline_budget(f"w4a8_spills_{n}", 48 if n == 128 else 112), f"{name}: spills {r}"
        assert ctas * (r["shared_bytes"] + CTA_RESERVED_BYTES) <= SM_SHARED_BYTES, r
        assert r["steps_in_loop"] == 4, f"{name}: the k loop is not the 4-step unrolled ring: {r}"
        barriers = offline_budget("w4a8_barriers_per_step", 1)
        assert r["BAR"] == barriers and r["QGMMA"] == 8, f"{name}: {r['BAR']} barriers, {r['QGMMA']} wgmma a step: {r}"
        assert r["LDGSTS"] == 4 and r["UTMALDG"] == 1, f"{name}: activation / weight copies per step: {r}"
        assert r["STS"] == r["STS_128"] == n // 32, f"{name}: the expanded tile not in 16-byte stores: {r}"
        assert r["PRMT"] >= n // 4 and r["F2FP"] == 0, f"{name}: words expanded by table per step: {r}"
        assert r["FFMA"] >= n // 2, f"{name}: the promotion's FFMAs: {r}"
        assert r["wgmma_waits_none_left"] <= 8, f"{name}: wgmma serialised (a wait after every MMA): {r}"
