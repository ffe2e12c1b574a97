"""The kappa and warp-specialised prefill kernels (ops/routed/gluon/routed_kappa.py, routed_staged_ws.py) compiled for
sm_90 on a machine without a GPU as their launchers compile them: registers, spills, shared memory per CTA and, per k
step of the 128-row MMA's main loop, what the step issues (JSON). Run by tests/test_kappa_compile_sm90.py in a fresh
interpreter without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import triton
from triton.experimental.gluon import language as gl

from latent_moe_fusion.ops.routed import gluon as gk
from latent_moe_fusion.ops.routed.gluon import staged_launch as sl
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, loop_ranges, registers, sass_of, spills

COMMON = {"s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32"}
KAPPA_SIG = {
    "l1": {"w_ptr": "*i32", **COMMON, "act_ptr": "*bf16", "inter": "i32", "K": "i32", "row_words": "i32",
           "row_scales": "i32", "stride_we": "i32", "stride_se": "i32", "beta": "fp32", "lin_beta": "fp32"},
    "l2": {"w_ptr": "*i32", **COMMON, "pairs_ptr": "*fp32", "latent": "i32", "K": "i32", "row_words": "i32",
           "row_scales": "i32", "stride_we": "i32", "stride_se": "i32"},
}
WS_SIG = {
    "l1": {"z_ptr": "*bf16", **COMMON, "act_ptr": "*bf16", "inter": "i32", "K": "i32", "row_scales": "i32",
           "top_k": "i32", "stride_se": "i32", "beta": "fp32", "lin_beta": "fp32", "num_tiles": "i32"},
    "l2": {**COMMON, "pairs_ptr": "*fp32", "latent": "i32", "K": "i32", "row_scales": "i32", "stride_se": "i32",
           "num_tiles": "i32"},
}
ACT_BOX = f"tensordesc<bf16[128, 128],{gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)!r}>"


def _words_box(which: str) -> str:
    rank = 3 if which == "l1" else 2
    box = "2, 64, 8" if which == "l1" else "128, 8"
    return f"tensordesc<i32[{box}],{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=rank)!r}>"


def _attrs(sig: dict) -> dict:
    # integer arguments the launchers pass are multiples of 16 at the real sizes (what the JIT specialises on)
    return {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
            if t != "fp32" and n not in ("top_k", "num_tiles") and not t.startswith("tensordesc")}


def compile_kappa(which: str, tiers: bool = True) -> triton.compiler.CompiledKernel:
    from latent_moe_fusion.ops.routed.gluon import routed_kappa as rk

    fn = rk.l1_kappa_kernel if which == "l1" else rk.l2_kappa_kernel
    sig = dict(KAPPA_SIG[which], a_desc=ACT_BOX)
    attrs = _attrs(sig)
    consts = {"BM": gk.STAGED_BLOCK_ROWS, "num_warps": gk.STAGED_WARPS, "TIERS": tiers}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ast_source(fn, sig, consts, attrs, gluon=True)
    return triton.compile(src, target=SM90,
                          options={"num_warps": gk.STAGED_WARPS, "maxnreg": gk.STAGED_MAX_REGISTERS})


def compile_ws(which: str) -> triton.compiler.CompiledKernel:
    from latent_moe_fusion.ops.routed.gluon import routed_staged_ws as ws

    i = 0 if which == "l1" else 1
    fn = ws.l1_ws_kernel if which == "l1" else ws.l2_ws_kernel
    sig = dict(WS_SIG[which], w_desc=_words_box(which))
    if which == "l2":
        sig["a_desc"] = f"tensordesc<bf16[128, 64],{gl.NVMMASharedLayout(128, 16, rank=2)!r}>"
    attrs = _attrs(sig)
    consts = {"STAGES": sl.WS_STAGES[i], "DEQUANT_WARPS": sl.WS_DEQUANT_WARPS[i],
              "DEQUANT_REGS": sl.WS_DEQUANT_REGS[i], "num_warps": gk.STAGED_WARPS}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ast_source(fn, sig, consts, attrs, gluon=True)
    return triton.compile(src, target=SM90, options={"num_warps": gk.STAGED_WARPS})


def compile_gather() -> triton.compiler.CompiledKernel:
    """triton/kappa_columns.py's gather as gather_kappa_rows launches it."""
    from latent_moe_fusion.ops.routed.triton import kappa_columns as kc

    sig = {"x_ptr": "*bf16", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "out_ptr": "*bf16", "rows": "i32",
           "n": "i32", "top_k": "i32", "ROWS": "constexpr", "BLOCK_ROWS": "constexpr", "CHUNKS": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    consts = {"ROWS": kc.ROWS_PER_GROUP, "BLOCK_ROWS": gk.STAGED_BLOCK_ROWS, "CHUNKS": kc.CHUNKS_PER_STEP}
    src = ast_source(kc.gather_kappa_rows_kernel, sig, consts, attrs)
    return triton.compile(src, target=SM90, options={"num_warps": kc.WARPS})


def mma_loops(sass: str) -> list[list[str]]:
    """Opcodes of the k loops of the 128-row MMA (one per tier of N): the loops with wgmma and without the
    epilogue's stores."""
    return [r for r in loop_ranges(sass) if any(o.startswith("HGMMA") for o in r)
            and not any(o.startswith(("MUFU", "STG")) for o in r)]


def step_counts(ops: list[str]) -> dict:
    """Per k step of one loop (one TMA copy a step): the instructions the design fixes."""
    hist = collections.Counter(op.split(".")[0] for op in ops)
    steps = max(hist["UTMALDG"], 1)
    return {"loop_instr": round(len(ops) / steps, 1),
            **{k: round(hist[k] / steps, 2) for k in ("BAR", "HGMMA", "UTMALDG", "LDG", "STS", "HMUL2", "LDL",
                                                       "LDGSTS", "WARPGROUP")},
            "LDG_128": round(sum(o.startswith("LDG.E.128") for o in ops) / steps, 2)}


def stats(family: str, which: str) -> dict:
    kernel = (compile_kappa if family == "kappa" else compile_ws)(which)
    sass = sass_of(kernel.asm["cubin"])
    row = {"kernel": f"{which}_{family}_kernel", "registers": registers(kernel.asm["cubin"]), "spills": spills(sass),
           "shared_bytes": kernel.metadata.shared, "setmaxnreg": sass.count("USETMAXREG")}
    if family == "kappa":
        row["loops"] = [step_counts(ops) for ops in mma_loops(sass)]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for kappa_sass.json")
    args = ap.parse_args()
    rows = [stats(f, w) for f in ("kappa", "ws") for w in ("l1", "l2")]
    gather = compile_gather()
    sass = sass_of(gather.asm["cubin"])
    rows.append({"kernel": "gather_kappa_rows_kernel", "registers": registers(gather.asm["cubin"]),
                 "spills": spills(sass), "STG_128": sass.count("STG.E.128"), "LDG_128": sass.count("LDG.E.128")})
    for r in rows:
        print(r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kappa_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
