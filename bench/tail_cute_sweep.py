"""Tile configurations of the CuTe DSL tail at decode sizes, side by side on one H200.

The table (ops/tail/cute/tail_configs.TABLE) gives every decode bucket one swap-AB tile: 64 hidden rows per
CTA (one warpgroup) by the bucket's token count, so N = 7168 makes 112 CTAs on 132 SMs, each reading its
whole activation block from L2 once per k step. This sweeps the alternatives at each M: smaller token
tiles (more CTAs, each weight tile read by several of them), two warpgroups per CTA, and the pipeline
depth. Every config is checked against a float64 reference on a poisoned output (and bitwise against the
table's config: the K order is the same), then all of one M are timed in alternating rounds of CUDA-graph
replays over rotating L2-cold input sets (bench.common.time_graphs_interleaved_ms), with the Triton tail
(the other backend of the bucket choice, tail_cute_choice.json) in the same rounds.

    PYTHONPATH=. python3 bench/tail_cute_sweep.py --out bench/results [--m 8 32 128] [--r 1] [--stages 4 8 12]
        [--full-only] [--name NAME]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, time_graphs_interleaved_ms, write_results  # noqa: E402
from bench.tail_cute import DTYPE, K, N, cases, checked_error, triton, triton_tail  # noqa: E402
from latent_moe_fusion.ops.tail.cute import tail_runtime  # noqa: E402
from latent_moe_fusion.ops.tail.cute.tail_configs import CuteTailConfig, pick_config  # noqa: E402

ERR_OK = 6e-3


def candidates(m: int, stages_list: tuple[int, ...] = (4, 8, 12), full_only: bool = False) -> list[CuteTailConfig]:
    """The table's config first, then swap-AB tiles of 64 hidden rows by tokens / 8 .. the bucket's tokens
    (at least 8) and of 128 rows by tokens / 2 and tokens (full_only: 64 rows by the bucket's tokens alone), at
    the pipeline depths of stages_list that fit shared memory."""
    table = pick_config(m)
    tokens = table.mma_n if table.swap_ab else m
    shapes = [(64, tokens)] if full_only else (
        [(64, n) for n in (tokens // 8, tokens // 4, tokens // 2, tokens)] + [(128, tokens // 2), (128, tokens)])
    out = [table]
    for mma_m, n in shapes:
        for stages in stages_list:
            cfg = CuteTailConfig(swap_ab=True, mma_m=mma_m, mma_n=n, stages=stages)
            try:
                cfg.check()
            except ValueError:
                continue
            if cfg not in out:
                out.append(cfg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=[8, 32, 64, 128])
    ap.add_argument("--r", type=int, nargs="+", default=[1])
    ap.add_argument("--stages", type=int, nargs="+", default=[4, 8, 12], help="pipeline depths to try")
    ap.add_argument("--full-only", action="store_true", help="only 64 hidden rows by the bucket's tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="tail_cute_sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    rows = []
    for m, r, inputs, ref, floor in cases(args.m, args.r, ceil):
        steps, info, first = {}, {}, None
        for cfg in candidates(m, tuple(args.stages), args.full_only):
            start = time.perf_counter()
            try:
                tail_runtime.compile_kernel(tail_runtime.KernelKey(tail_runtime.target_arch(), DTYPE, r, cfg))
            except Exception as exc:  # a config the kernel cannot build: recorded, not fatal
                info[cfg.label()] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            compile_s = time.perf_counter() - start

            def run(a, w, f, out, cfg=cfg):
                return tail_runtime.tail_cute_fused(a, w, f, out=out, cfg=cfg)

            err = checked_error(run, inputs, ref)
            out = inputs.out[0].clone()
            first = out if first is None else first
            info[cfg.label()] = {"err": err, "bitwise_table": bool(torch.equal(out, first)),
                                 "compile_s": round(compile_s, 1),
                                 "ctas": -(-N // cfg.hidden_per_tile) * -(-m // cfg.tokens_per_tile)}
            if err < ERR_OK:
                steps[cfg.label()] = (lambda i, run=run, x=inputs: run(x.a[i], x.w[i], x.f[i], x.out[i]))
        if triton_tail is not None:  # the Triton tail, for the per-bucket backend choice
            info["triton"] = {"err": checked_error(triton, inputs, ref)}
            steps["triton"] = lambda i, x=inputs: triton(x.a[i], x.w[i], x.f[i], x.out[i])
        times = time_graphs_interleaved_ms(steps, inputs.num, rounds=args.rounds)
        table_label = pick_config(m).label()
        for label, row_info in info.items():
            us = 1e3 * times[label] if label in times else float("nan")
            row = {"M": m, "R": r, "config": label, "table": label == table_label, "us": us, "floor_us": floor,
                   "x_floor": us / floor, "vs_table": 1e3 * times.get(table_label, float("nan")) / us} | row_info
            rows.append(row)
            print(row, flush=True)
    meta = environment() | {k: f"{v:.4g}" for k, v in ceil.items()} | {
        "K": K, "N": N, "dtype": "bfloat16",
        "timing": f"CUDA-graph replay over rotating L2-cold input sets, {args.rounds} alternating rounds, median"}
    cols = ["M", "R", "config", "table", "ctas", "us", "floor_us", "x_floor", "vs_table", "err", "bitwise_table",
            "compile_s", "error"]
    write_results(args.name, rows, cols, meta, args.out,
                  notes="config: swap = weight rows in the WGMMA M slot (hidden rows x tokens x k per step / "
                        "pipeline stages). table: the config tail_configs.TABLE serves this M with. vs_table: the "
                        "table config's time over this one (> 1: faster). ctas: grid size (132 SMs).")


if __name__ == "__main__":
    main()
