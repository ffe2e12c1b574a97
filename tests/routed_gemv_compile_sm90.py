"""The routed GEMV kernels (ops/routed/gluon/gluon_routed_gemv.py) compiled for sm_90 on a machine without a GPU at the
Kimi K3 rank sizes for the default shape (and the bf16x2-scaled lookup for comparison), with the counts of their K
loop (JSON). Run by tests/test_routed_gemv_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import replace
from pathlib import Path

import triton

from latent_moe_fusion.ops.routed.gluon import gluon_routed_gemv as rg
from latent_moe_fusion.ops.routed.routed_gemv import ROUTED_GEMV_CONFIG, RoutedGemvConfig
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, loop_ranges, registers, sass_of, spills

TYPES = ("*i32", "*i32", "*i32", "*u8", None, "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "fp32",
         "fp32")
NOT_DIVISIBLE = ("n_pairs", "top_k", "beta", "lin_beta")


def compile_sm90(dual: bool, cfg: RoutedGemvConfig, scale_sums: bool | None = None) -> triton.compiler.CompiledKernel:

    fn = rg.routed_gemv_l1_kernel if dual else rg.routed_gemv_l2_kernel
    names = fn.arg_names[: len(TYPES)]
    sig = {n: (t or ("*bf16" if dual else "*fp32")) for n, t in zip(names, TYPES, strict=True)}
    # Integer arguments the launcher passes are multiples of 16 at these sizes (what the JIT specialises on).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in NOT_DIVISIBLE}
    constexprs = dict(BLOCK_N=cfg.l1_rows if dual else cfg.l2_rows, WPT=cfg.words // (32 * cfg.num_warps), BLOCK_P=16,
                      num_warps=cfg.num_warps, FACTOR=cfg.scale_sums if scale_sums is None else scale_sums,
                      PREFETCH=cfg.prefetch)
    sig |= {k: "constexpr" for k in constexprs}
    src = ast_source(fn, sig, constexprs, attrs, gluon=True)
    options = {"num_warps": cfg.num_warps} | ({"maxnreg": cfg.max_registers} if cfg.max_registers else {})
    return triton.compile(src, target=SM90, options=options)


def k_loop(sass: str) -> list[str]:
    """Opcodes of the K loop: the longest backward-branch range with FP32 FMAs and no shuffle or MUFU
    (those belong to the item loop around it: the lane sum and the SiTU)."""
    inner = [r for r in loop_ranges(sass)
             if any(o.startswith("FFMA") for o in r) and not any(o.startswith(("SHFL", "MUFU")) for o in r)]
    return max(inner, key=len, default=[])


def loop_stats(dual: bool, cfg: RoutedGemvConfig, tokens: str, scale_sums: bool | None = None) -> dict:
    kernel = compile_sm90(dual, cfg, scale_sums)
    sass = sass_of(kernel.asm["cubin"])
    ops = k_loop(sass)
    hist = collections.Counter(op.split(".")[0] for op in ops)
    rows = cfg.l1_rows if dual else cfg.l2_rows
    per_step = (2 if dual else 1) * rows * cfg.words * 8  # weight elements per program and K step
    wpt = cfg.words // (32 * cfg.num_warps)
    return {"kernel": "routed_gemv_l1_kernel" if dual else "routed_gemv_l2_kernel", "tokens": tokens,
            "scale_sums": cfg.scale_sums if scale_sums is None else scale_sums, "rows": rows, "words": cfg.words,
            "warps": cfg.num_warps, "max_registers": cfg.max_registers, "registers": registers(kernel.asm["cubin"]), "loop_instr": len(ops),
            "per_element": round(len(ops) * cfg.num_warps * 32 / per_step, 2),
            "spill_ops": spills(sass),
            "STS": hist["STS"], "LDS": hist["LDS"], "BAR": hist["BAR"],
            "weight_vector_loads": sum(o.startswith(f"LDG.E.{32 * wpt}") for o in ops) if wpt > 1 else hist["LDG"],
            "FFMA": hist["FFMA"], "PRMT": hist["PRMT"], "HMUL2": hist["HMUL2"],
            "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(8))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for routed_gemv_sass.json")
    args = ap.parse_args()
    rows = [loop_stats(dual, ROUTED_GEMV_CONFIG, "1-4") for dual in (True, False)]
    # the bf16x2-scaled lookup for comparison, without the register cap (at 80 registers it spills)
    rows.append(loop_stats(True, replace(ROUTED_GEMV_CONFIG, max_registers=None), "1-4", scale_sums=False))
    for r in rows:
        print(r, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routed_gemv_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
