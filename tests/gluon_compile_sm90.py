"""The Gluon register-dequant kernels (ops/routed/gluon/routed_gemm.py) compiled for sm_90 on a machine without a
GPU at the Kimi K3 rank sizes, for every weight ring, K split, block rows and load order the launchers use, with
per k step counts of their main loop (JSON). Run by tests/test_gluon_compile_sm90.py in a fresh interpreter without
TRITON_INTERPRET; tests/fp8_compile_sm90.py and tests/pdl_compile_sm90.py reuse its kernel signatures.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import triton

from latent_moe_fusion.ops.routed import gluon as gk
from latent_moe_fusion.ops.routed.gluon import routed_gemm as rg
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, main_loop, registers, sass_of, spills

BM = gk.BLOCK_ROWS[0]

LATENT, INTER = 3584, 3072

L1_SIG = {"z_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
          "act_ptr": "*bf16", "h_part_ptr": "*fp32", "n_rows": "i32", "inter": "i32", "K": "i32", "row_words": "i32", "row_scales": "i32", "top_k": "i32",
          "stride_we": "i32", "stride_se": "i32", "beta": "fp32", "lin_beta": "fp32"}
L2_SIG = {"act_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
          "pairs_ptr": "*fp32", "slice_stride": "i32", "latent": "i32", "K": "i32", "row_words": "i32", "row_scales": "i32",
          "stride_we": "i32", "stride_se": "i32"}


def compile_sm90(which: str, split: int = 1, ring: str = "loads", order: str = "auto",
                 bm: int = BM) -> triton.compiler.CompiledKernel:
    from triton.experimental.gluon import language as gl

    fn, sig, warps = (rg.l1_regs_kernel, L1_SIG, gk.L1_WARPS) if which == "l1" else (rg.l2_regs_kernel, L2_SIG, gk.L2_WARPS)
    # Integer arguments the launcher passes are multiples of 16 at these sizes (what the JIT specialises on).
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t != "fp32" and n != "top_k"}
    kind, stages = gk.WEIGHT_RINGS[ring]
    constexprs = {"BM": bm, "BK": gk.STEP_K, "SPLIT": split, "num_warps": warps, "RING": kind, "STAGES": stages,
                  "ORDER": order}
    if kind == "tma":  # the launcher's descriptor (routed.gluon._words_descriptor)
        rows = 16 * warps
        box = f"2, {rows}, {gk.STEP_K // 8}" if which == "l1" else f"{rows}, {gk.STEP_K // 8}"
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3 if which == "l1" else 2)
        desc = f"tensordesc<i32[{box}],{layout!r}>"
    else:
        desc, constexprs["w_desc"] = "constexpr", None
    sig = dict(sig, w_desc=desc, BM="constexpr", BK="constexpr", SPLIT="constexpr", num_warps="constexpr",
               RING="constexpr", STAGES="constexpr", ORDER="constexpr")
    src = ast_source(fn, sig, constexprs, attrs, gluon=True)
    cap = gk.max_registers(which, kind, bm)
    options = {"num_warps": warps} | ({"maxnreg": cap} if cap else {})
    return triton.compile(src, target=SM90, options=options)


def loop_stats(which: str, split: int = 1, ring: str = "loads", order: str = "auto", bm: int = BM) -> dict:
    kernel = compile_sm90(which, split, ring, order, bm)
    sass = sass_of(kernel.asm["cubin"])
    ops = main_loop(sass)
    hist = collections.Counter(op.split(".")[0] for op in ops)
    warps = gk.L1_WARPS if which == "l1" else gk.L2_WARPS
    # k steps in the range: 8 wgmma (k 16 each) per tile and step, L1 gate + up (the ring loops are unrolled,
    # and the longest backward-branch range may take in their last steps too)
    steps = hist["HGMMA"] / (16 if which == "l1" else 8)
    per_step = (2 if which == "l1" else 1) * 16 * warps * gk.STEP_K  # weight elements per step (L1: gate + up)
    return {"kernel": f"{which}_regs_kernel", "ring": ring, "k_slices": split, "block_rows": bm, "order": order,
            "warps": warps, "rows": 16 * warps,
            "registers": registers(kernel.asm["cubin"]), "spills": spills(sass),
            "loop_instr": round(len(ops) / steps, 1), "per_element": round(len(ops) / steps * warps * 32 / per_step, 2),
            **{k: round(hist[k] / steps, 2) for k in ("BAR", "HGMMA", "STS", "LDS", "LDGSTS", "UTMALDG", "LDG", "HMUL2")},
            "LDG_128": round(sum(op.startswith("LDG.E.128") for op in ops) / steps, 2),
            "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(8))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for gluon_sass.json")
    args = ap.parse_args()
    # K slices (a single token's split) always take the loads (routed.gluon.ring_for)
    rows = [loop_stats(w, split, ring) for ring in gk.WEIGHT_RINGS for split in ((1, 2) if ring == "loads" else (1,))
            for w in ("l1", "l2")]
    # 32-row blocks (M = 128 at decode; the kernel holds a 16- and a 32-row MMA path): L1's TMA ring with either
    # load order (routed.gluon.LOAD_ORDERS; "auto" is late there), and L2 on its TMA ring
    rows += [loop_stats("l1", 1, "tma", order, 32) for order in ("early", "late")]
    rows.append(loop_stats("l2", 1, "tma", "auto", 32))
    # 64-row blocks (beyond decode; the kernels hold 16-, 32- and 64-row MMA paths, the loop counted is the longest):
    # both on the TMA ring, uncapped (routed.gluon.max_registers, default_rings)
    rows += [loop_stats(w, 1, "tma", "auto", 64) for w in ("l1", "l2")]
    for r in rows:
        print(r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gluon_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
