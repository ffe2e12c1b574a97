"""The producer's L1 and L2 kernels compile for sm_90 on this CPU machine (Triton + its bundled ptxas), for
the MXFP4 dequantisers in PTX (the default pairs variant and the table lookup): GPU-only failures (a non-constexpr global in @jit code, PTX that ptxas
rejects) surface here instead of on the H200. The CPU interpreter cannot see them: it runs no PTX.

Runs tests/triton_tiles_compile_sm90.py in a fresh interpreter: with TRITON_INTERPRET=1 (set for these tests on
a machine without CUDA) @triton.jit yields interpreted functions, which do not compile."""

import itertools
import json
from pathlib import Path

from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent


def test_l1_kernel_compiles_for_sm90_with_the_ptx_dequantisers(tmp_path):
    done = run_compiled([str(ROOT / "tests" / "triton_tiles_compile_sm90.py"), "--out", str(tmp_path), "--variants",
                         "asm_pairs", "lut", "--loads", "pointers", "tma", "--kernels", "l1", "l2"], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["kernel"], r["variant"], r["loads"]): r
            for r in json.loads((tmp_path / "triton_tiles_sass.json").read_text())}
    for key in itertools.product(("l1", "l2"), ("asm_pairs", "lut"), ("pointers", "tma")):
        assert key in rows, f"{key} missing from {sorted(rows)}"
        row = rows[key]
        assert row["loop_instr"] > 50, f"no main loop found for {key}"
        assert row["HMUL2"] > 0, f"{key}: no bf16x2 scale multiply (HMUL2) in the loop"
        assert (row["UTMALDG"] > 0) == (key[2] == "tma"), f"{key}: {row['UTMALDG']} UTMALDG in the loop"
