"""The router kernel compiles for sm_90 on this CPU machine (Triton + its bundled ptxas): GPU-only
failures (a non-constexpr global in @jit code, a layout the backend rejects) surface here, not on the
H200. The CPU interpreter cannot see them. Runs in a fresh interpreter without TRITON_INTERPRET."""

import pytest

from tests.compiled_python import run_compiled

SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from tests.offline_source import ast_source
from latent_moe_fusion.ops.router.triton.route_topk import noaux_tc_route_kernel, route_launch_shape
block_e, rows, warps = route_launch_shape({m}, 896)
sig = {{"logits_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32", "m_rows": "i32",
        "num_experts": "i32", "logits_row_stride": "i32", "first_expert": "i32", "num_local": "i32",
        "renorm_eps": "fp32", "scaling_factor": "fp32"}}
consts = dict(TOP_K={k}, TOP_K_POW2=triton.next_power_of_2({k}), BLOCK_E=block_e, ROWS=rows)
sig |= {{n: "constexpr" for n in consts}}
kernel = triton.compile(ast_source(noaux_tc_route_kernel, sig, consts),
                        target=GPUTarget("cuda", 90, 32), options={{"num_warps": warps}})
print("ptx-bytes", len(kernel.asm["ptx"]), "rows", rows, "warps", warps)
"""


@pytest.mark.parametrize("m, k", [(4096, 6)])  # one warp; top_k not a power of two (TOP_K_POW2 > TOP_K)
def test_route_kernel_compiles_for_sm90(m, k):
    done = run_compiled(["-c", SCRIPT.format(m=m, k=k)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ptx-bytes" in done.stdout and int(done.stdout.split()[1]) > 1000, done.stdout
