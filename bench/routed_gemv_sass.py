"""Static SASS of the routed GEMV kernels (ops/routed/gluon/gluon_routed_gemv.py) for sm_90, without a GPU:
both kernels compiled at the Kimi K3 rank sizes for the default shapes (Gluon + Triton's bundled ptxas)
and their K loop counted. What the design promises and this checks: nothing goes through shared memory
(the words, their 8 expanded values and the activation pairs stay in the registers of the thread that
loaded them), the weight words arrive in one vector load per row and step, and nothing spills. The count
per weight element is what bounds the kernels when the bytes do not (bench/results/routed_gemv.md).

    PYTHONPATH=. python3 bench/routed_gemv_sass.py --out bench/results
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import markdown_table  # noqa: E402
from bench.dequant_sass import loop_ranges, sass_of  # noqa: E402
from bench.regs_sass import registers  # noqa: E402
from latent_moe_fusion.ops.routed.gluon import gluon_routed_gemv as rg  # noqa: E402
from latent_moe_fusion.ops.routed.routed_gemv import (  # noqa: E402
    ROUTED_GEMV_CONFIG,
    RoutedGemvConfig,
)

TYPES = ("*i32", "*i32", "*i32", "*u8", None, "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "i32", "fp32",
         "fp32")
NOT_DIVISIBLE = ("n_pairs", "top_k", "beta", "lin_beta")


def compile_sm90(dual: bool, cfg: RoutedGemvConfig, scale_sums: bool | None = None) -> triton.compiler.CompiledKernel:
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = rg.routed_gemv_l1_kernel if dual else rg.routed_gemv_l2_kernel
    names = fn.arg_names[: len(TYPES)]
    sig = {n: (t or ("*bf16" if dual else "*fp32")) for n, t in zip(names, TYPES, strict=True)}
    # Integer arguments the launcher passes are multiples of 16 at these sizes (what the JIT specialises on).
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in NOT_DIVISIBLE}
    constexprs = dict(BLOCK_N=cfg.l1_rows if dual else cfg.l2_rows, WPT=cfg.words // (32 * cfg.num_warps), BLOCK_P=16,
                      num_warps=cfg.num_warps, FACTOR=cfg.scale_sums if scale_sums is None else scale_sums,
                      PREFETCH=cfg.prefetch)
    sig |= {k: "constexpr" for k in constexprs}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps} | ({"maxnreg": cfg.max_registers} if cfg.max_registers else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


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
            "spill_ops": sum(1 for line in sass.splitlines() if re.search(r"\b(LDL|STL)\b", line)),
            "STS": hist["STS"], "LDS": hist["LDS"], "BAR": hist["BAR"],
            "weight_vector_loads": sum(o.startswith(f"LDG.E.{32 * wpt}") for o in ops) if wpt > 1 else hist["LDG"],
            "FFMA": hist["FFMA"], "PRMT": hist["PRMT"], "HMUL2": hist["HMUL2"],
            "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(8))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    rows = [loop_stats(dual, ROUTED_GEMV_CONFIG, "1-4") for dual in (True, False)]
    # the bf16x2-scaled lookup for comparison, without the register cap (at 80 registers it spills)
    rows.append(loop_stats(True, replace(ROUTED_GEMV_CONFIG, max_registers=None), "1-4", scale_sums=False))
    for r in rows:
        print(r, flush=True)
    cols = ["kernel", "tokens", "scale_sums", "rows", "words", "warps", "max_registers", "registers", "loop_instr", "per_element",
            "spill_ops", "STS", "LDS", "BAR", "weight_vector_loads", "FFMA", "PRMT", "HMUL2", "top"]
    lines = [f"# Routed GEMV kernels: static SASS of the K loop (sm_90, triton {triton.__version__})", "",
             "L = 3584, I = 3072; compiled on a CPU machine, not timed. per_element: loop instructions per thread x "
             "32 lanes x warps / weight elements per step (L1: gate and up rows). scale_sums False is the "
             "bf16x2-scaled lookup (spec suffix b).", "",
             markdown_table(rows, cols)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routed_gemv_sass.md").write_text("\n".join(lines) + "\n")
    (out / "routed_gemv_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
