"""The FP8 routed kernels (ops/routed/gluon/routed_fp8.py) and the bf16 L2 in the 8-row blocks the FP8 L1 shares
with it, compiled for sm_90 on a machine without a GPU as their launchers call them, with per k step counts of each
K loop (JSON). Run by tests/test_routed_fp8.py in a fresh interpreter without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import triton

from latent_moe_fusion.ops.routed import gluon as gk
from latent_moe_fusion.ops.routed.gluon import routed_fp8 as rf
from tests.gluon_compile_sm90 import compile_sm90
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, registers, sass_of, spills

L1_FP8_SIG = {"z_hi_ptr": "*fp8e4nv", "z_lo_ptr": "*fp8e4nv", "col_factor_ptr": "*fp32", "s_ptr": "*u8",
              "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "act_ptr": "*bf16", "inter": "i32", "K": "i32",
              "row_scales": "i32", "top_k": "i32", "stride_se": "i32", "beta": "fp32", "lin_beta": "fp32"}


L2_FP8_SIG = {"a_hi_ptr": "*fp8e4nv", "a_lo_ptr": "*fp8e4nv", "row_factor_ptr": "*fp32", "s_ptr": "*u8",
              "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "pairs_ptr": "*fp32", "latent": "i32", "K": "i32",
              "row_scales": "i32", "stride_se": "i32"}


def compile_fp8(which: str, bm: int, mma: str = "pipe") -> triton.compiler.CompiledKernel:
    """l1_fp8_kernel or l2_fp8_kernel as their launchers call them (routed.gluon.launch_routed_l*_fp8)."""
    from triton.experimental.gluon import language as gl

    l1 = which == "l1"
    fn, sig, warps = (rf.l1_fp8_kernel, L1_FP8_SIG, gk.L1_WARPS) if l1 else (rf.l2_fp8_kernel, L2_FP8_SIG, gk.L2_WARPS)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t != "fp32" and n != "top_k"}
    layout = gl.NVMMASharedLayout(swizzle_byte_width=gk.FP8_WORDS_SWIZZLE, element_bitwidth=32, rank=3 if l1 else 2)
    box = f"2, {16 * warps}, {gk.STEP_K // 8}" if l1 else f"{16 * warps}, {gk.STEP_K // 8}"
    sig = dict(sig, w_desc=f"tensordesc<i32[{box}],{layout!r}>", BM="constexpr", BK="constexpr",
               num_warps="constexpr", MMA="constexpr")
    src = ast_source(fn, sig, {"BM": bm, "BK": gk.STEP_K, "num_warps": warps, "MMA": mma}, attrs, gluon=True)
    return triton.compile(src, target=SM90, options={"num_warps": warps})


def k_loops(sass: str) -> list[list[str]]:
    """Opcodes of each innermost backward-branch range that issues wgmmas: the unrolled K loops of the MMA paths."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);", sass)
    addr = [(int(a, 16), op, rest) for a, op, rest in lines]
    spans = []
    for a, op, rest in addr:
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < a:
            ops = [o for x, o, _ in addr if int(m.group(1), 16) <= x <= a]
            # the wait loops placed after the kernel's end branch back into the K loop: their ranges span the
            # epilogue (SiTU: MUFU) and the exit
            if any("GMMA" in o for o in ops) and not any(o.startswith(("EXIT", "MUFU")) for o in ops):
                spans.append((int(m.group(1), 16), a, ops))
    return [ops for s, e, ops in spans if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2, _ in spans)]


def stats(name: str, kernel: triton.compiler.CompiledKernel, mmas_per_step: int, bm: int) -> list[dict]:
    sass = sass_of(kernel.asm["cubin"])
    rows = []
    for ops in k_loops(sass):
        hist = collections.Counter(op.split(".")[0] for op in ops)
        mma = next(op for op in ops if "GMMA" in op)
        steps = sum("GMMA" in op for op in ops) / mmas_per_step
        rows.append({"kernel": name, "block_rows": bm, "mma": mma, "registers": registers(kernel.asm["cubin"]),
                     "spills": spills(sass), "loop_instr": round(len(ops) / steps, 1),
                     "wgmma": round(sum("GMMA" in op for op in ops) / steps, 2),
                     "FFMA": round(hist["FFMA"] / steps, 2), "HMUL2": round(hist["HMUL2"] / steps, 2),
                     "LOP3": round(hist["LOP3"] / steps, 2), "BAR": round(hist["BAR"] / steps, 2),
                     "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(8))})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for fp8_sass.json")
    args = ap.parse_args()
    rows = []
    for bm in gk.FP8_BLOCK_ROWS[:2]:
        rows += stats("l1_fp8_kernel", compile_fp8("l1", bm), 16, bm)
    rows += stats("l2_fp8_kernel", compile_fp8("l2", 8), 8, 8)
    rows += stats("l2_regs_kernel", compile_sm90("l2", ring="tma", bm=8), 8, 8)
    for r in rows:
        print(r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
