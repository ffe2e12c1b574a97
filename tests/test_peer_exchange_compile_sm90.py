"""The symmetric-memory exchange kernel compiles for sm_90 on this CPU machine (Triton's bundled ptxas): the
system-scope acquire / release atomics, the int64 -> pointer casts and the spin loops must lower for the GPU,
which the interpreter (tests/test_symm_exchange.py) cannot show. Also: its atomics are the system-scope ones."""

import pytest

from tests.compiled_python import run_compiled

SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from tests.offline_source import ast_source
from latent_moe_fusion.ops.common.peer_exchange import MAX_PROGRAMS, Chunks, peer_exchange_kernel
chunks = Chunks.of({rows}, {cols})
sig = {{"src_ptr": "*bf16", "src_part_stride": "i64", "src_row_stride": "i64", "out_ptr": "*bf16",
        "out_slot_stride": "i64", "out_row_stride": "i64", "ws_table": "*i64", "flag_table": "*i64",
        "places": "i32", "per_program": "i32", "place_elems": "i32", "rank": "i32", "rows": "i32", "cols": "i32", "n_col_blocks": "i32",
        "n_chunks": "i32"}}
consts = dict(WORLD={world}, MAX_PROGRAMS=MAX_PROGRAMS, BLOCK_R=chunks.block_r, BLOCK_C=chunks.block_c)
sig |= {{n: "constexpr" for n in consts}}
kernel = triton.compile(ast_source(peer_exchange_kernel, sig, consts),
                        target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
ptx = kernel.asm["ptx"]
atoms = [line for line in ptx.split("\\n") if "atom.global" in line and ".sys" in line]
print("ptx-bytes", len(ptx), "sys-acquire", sum("acquire" in a for a in atoms),
      "sys-release", sum("release" in a for a in atoms))
"""


@pytest.mark.parametrize("world, rows, cols", [(2, 8, 3584), (8, 4096, 7168)])  # TP decode gather; SP prefill, R = 8
def test_exchange_kernel_compiles_for_sm90(world, rows, cols):
    done = run_compiled(["-c", SCRIPT.format(world=world, rows=rows, cols=cols)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    words = done.stdout.split()
    assert words[0] == "ptx-bytes" and int(words[1]) > 1000, done.stdout
    assert int(words[3]) >= 2 and int(words[5]) >= 2, f"expected system-scope acquire and release atomics: {done.stdout}"
