"""The latent down-projection z = x @ w_down^T alone (H = 7168 -> L = 3584, BF16): cuBLAS against the tail's
Triton swap-AB kernel with no fragments (ops/routed/router_fused/down_projection.py), over decode M.

Each variant is one CUDA graph over rotating weight copies (L2-cold), the graphs replayed in alternating
rounds. Floor: bytes of w_down + x + z once over the measured copy bandwidth. Errors: relative L2 against a
float64 matmul of the same inputs.

    PYTHONPATH=. python3 bench/down_projection.py --out bench/results            # the table's configs
    PYTHONPATH=. python3 bench/down_projection.py --out DIR --configs LABEL ...   # other swap configs too
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graphs_interleaved_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.routed.router_fused.down_projection import (  # noqa: E402
    parse_swap_label,
    project_down_triton,
    table_config,
)

H, L = 7168, 3584
DECODE_M = (1, 2, 4, 8, 16, 32, 64)
WEIGHT_SETS = 4  # 4 x 51 MB: every call reads w_down from HBM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(DECODE_M))
    ap.add_argument("--configs", nargs="*", default=[], help="extra swap-kernel labels, timed where block_m >= M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="down_projection")
    args = ap.parse_args()
    extra = [parse_swap_label(label) for label in args.configs]
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    ws = [torch.randn(L, H, device="cuda", dtype=torch.bfloat16) * H**-0.5 for _ in range(WEIGHT_SETS)]
    rows = []
    for m in args.m:
        xs = [torch.randn(m, H, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_SETS)]
        zs = [torch.empty(m, L, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_SETS)]
        configs = {"triton table": table_config(m)} | {cfg.label(): cfg for cfg in extra if cfg.block_m >= m}
        configs = {name: cfg for name, cfg in configs.items() if cfg is not None}
        steps = {"cublas": lambda i: torch.mm(xs[i], ws[i].t(), out=zs[i])}
        for name, cfg in configs.items():
            steps[name] = lambda i, cfg=cfg: project_down_triton(xs[i], ws[i], zs[i], cfg)
        errors = {}
        ref = xs[0].double() @ ws[0].double().t()
        for name, step in steps.items():
            zs[0].fill_(float("nan"))  # poison: every element must be written
            step(0)
            errors[name] = rel_l2(zs[0], ref)
        times = time_graphs_interleaved_ms(steps, WEIGHT_SETS, rounds=args.rounds)
        floor_us = (L * H + m * H + m * L) * 2 / ceilings["copy_bytes_per_s"] * 1e6
        for name in steps:
            us = times[name] * 1e3
            rows.append({"M": m, "variant": name, "config": configs[name].label() if name in configs else "torch.mm",
                         "us": us, "floor_us": floor_us, "x_floor": us / floor_us,
                         "vs_cublas": times["cublas"] / times[name], "rel_l2_vs_fp64": errors[name]})
            print(rows[-1], flush=True)
    meta = environment() | {
        "shape": f"x [M, {H}] @ w_down[{L}, {H}]^T, bf16, FP32 accumulation",
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "timing": f"one CUDA graph per variant over {WEIGHT_SETS} weight copies (L2-cold), {args.rounds} alternating "
                  "rounds of 6 replays, median per call",
        "floor": "bytes of w_down + x + z once / copy bandwidth",
    }
    write_results(args.name, rows, ["M", "variant", "config", "us", "floor_us", "x_floor", "vs_cublas",
                                    "rel_l2_vs_fp64"], meta, args.out)


if __name__ == "__main__":
    main()
