"""Programmatic dependent launch (ops/pdl.py) on the decode block: what each PDL site buys.

The compiled + fused Kimi K3 rank block (block.py's configuration) is captured in one CUDA graph per
setting of LMF_PDL (none, each site alone, all) and, at M = 1, per L2 prefetch depth of the tail
(LMF_TAIL_PREFETCH, K steps of 128 per weight row); the compiled block without the pass is the baseline.
The settings are timed in alternating rounds (graph replay over rotating inputs, median of the rounds'
medians), so drift of the machine hits all of them alike. Outputs of every setting are compared bitwise
with LMF_PDL=none (PDL changes when kernels start, never what they compute).

    PYTHONPATH=. python3 bench/pdl.py --out bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compile_afresh, compiled, kimi_rank_block  # noqa: E402
from bench.common import env_applied, environment, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.pdl import PDL_ENV  # noqa: E402
from latent_moe_fusion.ops.triton_kernels.tail import PREFETCH_ENV, TAIL_PREFETCH_STEPS  # noqa: E402

SETTINGS = ("none", "tail", "routed", "all")
PREFETCH_SWEEP = (0, 2, 4, 7, 14)


def _with_env(env: dict[str, str], fn):
    with env_applied(env):
        return fn()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    compile_afresh()
    block = kimi_rank_block("bf16")
    base, _ = compiled(block, False)
    fused, fpass = compiled(block, True)
    rows = []
    for m in args.m:
        num_sets = 4
        xs = [torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
        variants: dict[str, dict[str, str]] = {f"pdl={s}": {PDL_ENV: s} for s in SETTINGS}
        if m == 1:
            variants |= {f"pdl=all,prefetch={p}": {PDL_ENV: "all", PREFETCH_ENV: str(p)} for p in PREFETCH_SWEEP
                         if p != TAIL_PREFETCH_STEPS}
        ref = _with_env({PDL_ENV: "none"}, lambda: fused(xs[0]).clone())
        row = {"M": m, "matched": fpass.report.matched}
        for name, env in variants.items():
            out = _with_env(env, lambda: fused(xs[0]))
            row[f"{name}_bitwise"] = bool(torch.equal(out, ref))
        samples: dict[str, list[float]] = {name: [] for name in ["compiled", *variants]}
        for _ in range(args.rounds):
            samples["compiled"].append(time_graph_ms(lambda i: base(xs[i]), num_sets) * 1e3)
            for name, env in variants.items():
                samples[name].append(_with_env(env, lambda: time_graph_ms(lambda i: fused(xs[i]), num_sets)) * 1e3)
        for name, values in samples.items():
            row[f"{name}_us"] = statistics.median(values)
        for name in variants:
            row[f"{name}_vs_compiled"] = row["compiled_us"] / row[f"{name}_us"]
        rows.append(row)
        print(row, flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584, H=7168, shared 768, "
                  "R=1, router GEMM bf16; compiled + fused block (router rewrite on)",
        "timing": f"CUDA graph replay over 4 rotating inputs, median per round, median of {args.rounds} alternating "
                  "rounds; one graph captured per setting and round",
        "default_prefetch_steps": TAIL_PREFETCH_STEPS,
    }
    cols = ["M", "compiled_us"] + [c for c in rows[0] if c.startswith("pdl=") and c.endswith("_us")]
    cols += [c for c in rows[0] if c.endswith("_vs_compiled")] + [c for c in rows[0] if c.endswith("_bitwise")]
    write_results("pdl", rows, cols, meta, args.out)


if __name__ == "__main__":
    main()
