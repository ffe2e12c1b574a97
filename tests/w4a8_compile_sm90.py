"""The W4A8 prefill kernels (ops/routed/gluon/routed_w4a8.py) compiled for sm_90 on a machine without a GPU as their
launchers compile them (ops/routed/w4a8_path.py): registers and spills, shared memory per CTA, and per 128-wide k step
of the main loop the CTA barriers, FP8 wgmma, cp.async copies of the activation rows, TMA copies, 16-byte shared
stores of the expanded tile, table lookups (prmt), and whether the step keeps its wgmma in flight
(JSON). Run by tests/test_w4a8_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import triton

from latent_moe_fusion.ops.routed import w4a8_path as wp
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, loop_ranges, registers, sass_of, spills

L1_SIG = {"z8_ptr": "*fp8e4nv", "zs_ptr": "*fp32", "s_ptr": "*u8", "g_ptr": "*u8", "tab_ptr": "*i32", "sorted_ptr": "*i32",
          "block_expert_ptr": "*i32", "act_ptr": "*bf16", "inter": "i32", "K": "i32", "row_scales": "i32",
          "top_k": "i32", "stride_se": "i32", "stride_ge": "i32", "beta": "fp32", "lin_beta": "fp32"}
L2_SIG = {"a8_ptr": "*fp8e4nv", "as_ptr": "*fp32", "s_ptr": "*u8", "g_ptr": "*u8", "tab_ptr": "*i32", "sorted_ptr": "*i32",
          "block_expert_ptr": "*i32", "pairs_ptr": "*fp32", "latent": "i32", "K": "i32", "row_scales": "i32",
          "stride_se": "i32", "stride_ge": "i32"}


def compile_sm90(which: str, rows: int) -> triton.compiler.CompiledKernel:
    """L1 or L2 as w4a8_path.launch_l1_w4a8 / launch_l2_w4a8 compile it for programs of `rows` weight rows."""
    from triton.experimental.gluon import language as gl

    from latent_moe_fusion.ops.routed.gluon import routed_w4a8 as rw

    fn, sig = (rw.l1_w4a8_kernel, L1_SIG) if which == "l1" else (rw.l2_w4a8_kernel, L2_SIG)
    # Integer arguments the launcher passes are multiples of 16 at the real sizes (what the JIT specialises on).
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t != "fp32" and n != "top_k"}
    box = f"2, {rows // 2}, 16" if which == "l1" else f"{rows}, 16"
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3 if which == "l1" else 2)
    sig = dict(sig, w_desc=f"tensordesc<i32[{box}],{layout!r}>", BM="constexpr", BN="constexpr", num_warps="constexpr")
    src = ast_source(fn, sig, {"BM": wp.W4A8_BLOCK_ROWS, "BN": rows, "num_warps": wp.W4A8_WARPS}, attrs, gluon=True)
    options = {"num_warps": wp.W4A8_WARPS}
    if wp.W4A8_MAX_REGISTERS[rows] is not None:
        options["maxnreg"] = wp.W4A8_MAX_REGISTERS[rows]
    return triton.compile(src, target=SM90, options=options)


def k_loop(sass: str) -> list[str]:
    """Opcodes of the k loop: the backward-branch range with the most wgmma, without the epilogue's stores."""
    loops = [r for r in loop_ranges(sass) if any(o.startswith(("HGMMA", "QGMMA")) for o in r)
             and not any(o.startswith(("MUFU", "STG")) for o in r)]
    return max(loops, key=lambda r: (sum(o.startswith(("HGMMA", "QGMMA")) for o in r), len(r)), default=[])


def stats(which: str, rows: int) -> dict:
    kernel = compile_sm90(which, rows)
    sass = sass_of(kernel.asm["cubin"])
    ops = k_loop(sass)
    hist = collections.Counter(op.split(".")[0] for op in ops)
    steps = hist["QGMMA"] / 8  # two [128 x 64 x 128] MMAs a step, 4 k32 wgmma each
    return {
        "kernel": f"{which}_w4a8_kernel", "rows": rows, "warps": wp.W4A8_WARPS,
        "registers": registers(kernel.asm["cubin"]), "spills": spills(sass),
        "shared_bytes": kernel.metadata.shared, "steps_in_loop": steps,
        "loop_instr": round(len(ops) / max(steps, 1), 1),
        **{k: round(hist[k] / max(steps, 1), 2) for k in ("BAR", "QGMMA", "LDGSTS", "UTMALDG", "STS", "LDS", "PRMT",
                                                         "F2FP", "FFMA", "LDG")},
        "STS_128": round(sum(o.startswith("STS.128") for o in ops) / max(steps, 1), 2),
        "wgmma_waits_none_left": len(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", sass)),
        "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(10)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for w4a8_sass.json")
    ap.add_argument("--dump", default="", help="also write the kernels' SASS into this folder")
    args = ap.parse_args()
    rows = []
    for which in ("l1", "l2"):
        for weight_rows in wp.W4A8_ROWS:
            rows.append(stats(which, weight_rows))
            print(rows[-1], flush=True)
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                sass = sass_of(compile_sm90(which, weight_rows).asm["cubin"])
                (Path(args.dump) / f"{which}_w4a8_{weight_rows}.sass").write_text(sass)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "w4a8_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
