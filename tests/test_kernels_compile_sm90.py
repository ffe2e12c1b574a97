"""The producer's L1 and L2 kernels compile for sm_90 on this CPU machine (Triton + its bundled ptxas), for
the MXFP4 dequantisers in PTX (the default pairs variant and the table lookup): GPU-only failures (a non-constexpr global in @jit code, PTX that ptxas
rejects) surface here instead of on the H200. The CPU interpreter cannot see them: it runs no PTX.

Runs bench/dequant_sass.py in a fresh interpreter: with TRITON_INTERPRET=1 (set for this test
session on a machine without CUDA) @triton.jit yields interpreted functions, which do not compile."""

import itertools
from pathlib import Path

from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent


def test_l1_kernel_compiles_for_sm90_with_the_ptx_dequantisers(tmp_path):
    done = run_compiled([str(ROOT / "bench" / "dequant_sass.py"), "--out", str(tmp_path), "--variants", "asm_pairs",
                         "lut", "--loads", "pointers", "tma", "--kernels", "l1", "l2"], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "dequant_sass.md").read_text()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| ")]
    rows = {tuple(c[:3]): c for c in cells[1:]}
    for key in itertools.product(("l1", "l2"), ("asm_pairs", "lut"), ("pointers", "tma")):
        assert key in rows, f"{key} missing from\n{table}"
        row = rows[key]
        assert int(row[3]) > 50, f"no main loop found for {key}"
        assert int(row[7]) > 0, f"{key}: no bf16x2 scale multiply (HMUL2) in the loop"
        assert (int(row[6]) > 0) == (key[2] == "tma"), f"{key}: {row[6]} UTMALDG in the loop"
