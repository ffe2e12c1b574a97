"""The staged prefill kernels (gluon_kernels/routed_staged.py) compiled for sm_90 on a machine without a GPU as their
launchers compile them: registers and spills under the launch cap, shared memory per CTA, and per k step of the
128-row MMA's main loop the CTA barriers, wgmma, cp.async copies of the activation rows, TMA copies, 16-byte shared
stores of the dequantised tile, and whether the step keeps a wgmma in flight (JSON). Run by
tests/test_staged_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import triton

from latent_moe_fusion.ops.routed import gluon as gk
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, loop_ranges, registers, sass_of, spills

L1_SIG = {"z_ptr": "*bf16", "s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "act_ptr": "*bf16",
          "inter": "i32", "K": "i32", "row_scales": "i32", "top_k": "i32", "stride_se": "i32", "beta": "fp32",
          "lin_beta": "fp32"}
L2_SIG = {"act_ptr": "*bf16", "s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "pairs_ptr": "*fp32",
          "latent": "i32", "K": "i32", "row_scales": "i32", "stride_se": "i32"}


def compile_sm90(which: str) -> triton.compiler.CompiledKernel:
    """The staged L1 or L2 as the launcher compiles it (routed.gluon.staged_launch.launch_staged_l1 / _l2)."""
    from triton.experimental.gluon import language as gl

    from latent_moe_fusion.ops.routed.gluon import routed_staged as rs

    fn, sig = (rs.l1_staged_kernel, L1_SIG) if which == "l1" else (rs.l2_staged_kernel, L2_SIG)
    # Integer arguments the launcher passes are multiples of 16 at the real sizes (what the JIT specialises on).
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t != "fp32" and n != "top_k"}
    rows, words = 16 * gk.STAGED_WARPS, gk.STAGED_STEP_K // 8
    box = f"2, {rows // 2}, {words}" if which == "l1" else f"{rows}, {words}"
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3 if which == "l1" else 2)
    sig = dict(sig, w_desc=f"tensordesc<i32[{box}],{layout!r}>", BM="constexpr", num_warps="constexpr")
    src = ast_source(fn, sig, {"BM": gk.STAGED_BLOCK_ROWS, "num_warps": gk.STAGED_WARPS}, attrs, gluon=True)
    return triton.compile(src, target=SM90,
                          options={"num_warps": gk.STAGED_WARPS, "maxnreg": gk.STAGED_MAX_REGISTERS})


def full_rows_loop(sass: str) -> list[str]:
    """Opcodes of the k loop of the 128-row MMA: the backward-branch range with the most cp.async copies per wgmma
    (the 64-row path copies half the rows), without the epilogue's SiTU (MUFU) or stores (ranges of peeled iterations
    span it)."""
    loops = [r for r in loop_ranges(sass) if any(o.startswith("HGMMA") for o in r)
             and not any(o.startswith(("MUFU", "STG")) for o in r)]

    def copies_per_mma(r: list[str]) -> float:
        return sum(o.startswith("LDGSTS") for o in r) / sum(o.startswith("HGMMA") for o in r)

    return max(loops, key=lambda r: (copies_per_mma(r), len(r)), default=[])


def stats(which: str) -> dict:
    kernel = compile_sm90(which)
    sass = sass_of(kernel.asm["cubin"])
    ops = full_rows_loop(sass)
    hist = collections.Counter(op.split(".")[0] for op in ops)
    steps = hist["HGMMA"] / 4  # 4 wgmma (k 16 each) per 64-wide k step
    return {
        "kernel": f"{which}_staged_kernel", "warps": gk.STAGED_WARPS, "maxnreg": gk.STAGED_MAX_REGISTERS,
        "registers": registers(kernel.asm["cubin"]), "spills": spills(sass),
        "shared_bytes": kernel.metadata.shared, "loop_instr": round(len(ops) / steps, 1),
        **{k: round(hist[k] / steps, 2) for k in ("BAR", "HGMMA", "LDGSTS", "UTMALDG", "STS", "LDS", "HMUL2")},
        "STS_128": round(sum(o.startswith("STS.128") for o in ops) / steps, 2),
        # waits that leave the last wgmma in flight (the overlap) against waits for all of them (after the loop)
        "wgmma_waits_one_left": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1", sass)),
        "wgmma_waits_none_left": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)),
        "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(8)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for staged_sass.json")
    args = ap.parse_args()
    rows = [stats(w) for w in ("l1", "l2")]
    for r in rows:
        print(r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "staged_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
