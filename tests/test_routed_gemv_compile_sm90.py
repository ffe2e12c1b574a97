"""The routed GEMV kernels compile for sm_90 on this CPU machine and their K loop is what the design says:
no shared memory and no barrier (every word, its 8 expanded values and the activation pairs stay in the
registers of the thread that loaded them), one vector load per weight row and step, no spills, one FP32
FMA per weight element, and with scaled sums no bf16x2 scale multiply.

Runs tests/routed_gemv_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET (which these tests set)."""

import json
from pathlib import Path

from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent


def test_routed_gemv_kernels_keep_everything_in_registers(tmp_path):
    done = run_compiled([str(ROOT / "tests" / "routed_gemv_compile_sm90.py"), "--out", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "routed_gemv_sass.json").read_text())
    assert {(r["kernel"], r["tokens"]) for r in rows} == {
        (k, "1-4") for k in ("routed_gemv_l1_kernel", "routed_gemv_l2_kernel")}, rows
    for r in rows:
        l1 = r["kernel"] == "routed_gemv_l1_kernel"
        name = f"{r['kernel']} ({r['tokens']} tokens, scale_sums {r['scale_sums']})"
        assert r["loop_instr"] > 50, f"{name}: no K loop found"
        assert r["spill_ops"] == 0, f"{name}: {r['spill_ops']} local-memory instructions (spills)"
        assert r["STS"] == r["LDS"] == r["BAR"] == 0, f"{name}: shared memory in the K loop: {r['top']}"
        weight_rows = r["rows"] * (2 if l1 else 1)
        assert r["weight_vector_loads"] == weight_rows, f"{name}: weight words not in one vector load per row: {r}"
        elements_per_thread = weight_rows * r["words"] * 8 // (32 * r["warps"])
        assert r["FFMA"] == elements_per_thread, f"{name}: {r['FFMA']} FMAs for {elements_per_thread} elements"
        assert r["PRMT"] > 0, f"{name}: no table lookup"
        if r["scale_sums"]:
            assert r["HMUL2"] == 0, f"{name}: bf16x2 scale multiplies although sums are scaled: {r['top']}"
