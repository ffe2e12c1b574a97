"""Where the shared expert should run, measured on the whole block (compiled + fused), every placement
timed in the same process in alternating rounds. Separate processes of the same script and seed have
differed by up to ~10 us at M = 1 (cause not identified), and scripts that draw different inputs differ
more, since each input routes to its own experts.

Decode (beside the register-dequant routed kernels): each `LMF_REGS_SHARED` placement (side,
cublas_side, cublas) captured in CUDA graphs; feeds `expert_schedule.shared_strategy`. Prefill (the
Triton routed grids, no graph): `LMF_GRID_SHARED` grid or cublas, CUDA events around calls
back to back in alternating rounds; feeds `expert_schedule.grid_shared_strategy`.

    PYTHONPATH=. python3 bench/shared_strategy.py --out bench/results
    PYTHONPATH=. python3 bench/shared_strategy.py --m --prefill-m 4096 --name shared_strategy_prefill  # prefill only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compiled_rank_block  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    rel_l2,
    time_back_to_back_interleaved_ms,
    time_graph_ms,
    write_results,
)
from latent_moe_fusion.ops.routed.expert_schedule import (  # noqa: E402
    GRID_SHARED_ENV,
    GRID_SHARED_STRATEGIES,
    SHARED_ENV,
    SHARED_STRATEGIES,
    grid_shared_strategy,
    shared_strategy,
)

DECODE_M = (1, 2, 4, 8, 12, 16, 32)
PREFILL_M = (4096,)


def prefill_row(m: int, plain, fused, block, cfg, rounds: int) -> dict:
    x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    ref = block(x)
    row = {"M": m, "default": grid_shared_strategy(m)}

    def placed(strategy: str):
        def run():
            os.environ[GRID_SHARED_ENV] = strategy  # read at every call (no graph at prefill)
            return fused(x)
        return run

    for strategy in GRID_SHARED_STRATEGIES:
        row[f"{strategy}_err"] = rel_l2(placed(strategy)(), ref)
    fns = {"compiled": lambda: plain(x)} | {s: placed(s) for s in GRID_SHARED_STRATEGIES}
    row |= {f"{name}_us": 1e3 * ms for name, ms in time_back_to_back_interleaved_ms(fns, rounds=rounds * 3).items()}
    os.environ.pop(GRID_SHARED_ENV)
    row["best"] = min(GRID_SHARED_STRATEGIES, key=lambda s: row[f"{s}_us"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(DECODE_M))
    ap.add_argument("--prefill-m", type=int, nargs="*", default=list(PREFILL_M))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="shared_strategy")
    args = ap.parse_args()
    block, plain, fused, fpass = compiled_rank_block()
    cfg = block.cfg
    forced = {env: os.environ.pop(env, None) for env in (SHARED_ENV, GRID_SHARED_ENV)}
    rows = []
    for m in args.m:
        xs = [torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        ref = block(xs[0])
        times: dict[str, list[float]] = {"compiled": [], **{s: [] for s in SHARED_STRATEGIES}}
        row = {"M": m, "default": shared_strategy(m)}
        for _ in range(args.rounds):
            times["compiled"].append(1e3 * time_graph_ms(lambda i: plain(xs[i]), len(xs)))
            for strategy in SHARED_STRATEGIES:
                os.environ[SHARED_ENV] = strategy  # read when the op runs, i.e. at each capture
                row[f"{strategy}_err"] = rel_l2(fused(xs[0]), ref)
                times[strategy].append(1e3 * time_graph_ms(lambda i: fused(xs[i]), len(xs)))
            os.environ.pop(SHARED_ENV)
        row["matched"] = fpass.report.matched
        row |= {f"{name}_us": statistics.median(v) for name, v in times.items()}
        row["best"] = min(SHARED_STRATEGIES, key=lambda s: row[f"{s}_us"])
        rows.append(row)
        print(row, flush=True)
    for m in args.prefill_m:
        rows.append(prefill_row(m, plain, fused, block, cfg, args.rounds) | {"matched": fpass.report.matched})
        print(rows[-1], flush=True)
    os.environ.update({env: value for env, value in forced.items() if value is not None})
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, shared 768, R=1, router GEMM bf16",
        "timing": f"decode: CUDA graph replay over 4 rotating inputs, median of {args.rounds} alternating rounds; "
                  f"prefill: CUDA events around 4 calls back to back, median of {3 * args.rounds} alternating rounds",
    }
    cols = ["M", "compiled_us", "side_us", "cublas_side_us", "grid_us", "cublas_us", "best", "default", "matched",
            "side_err", "cublas_side_err", "grid_err", "cublas_err"]
    write_results(args.name, rows, cols, meta, args.out)


if __name__ == "__main__":
    main()
