"""Does one CUDA-graph capture of the decode block run like another? A serving engine captures once per batch
size and replays that graph for good, so a capture that came out slower (another ordering of the side
streams' kernels, say) would stay slower. This captures the compiled + fused block (and the compiled one)
several times in one process, graphs of one call and of four calls on rotating inputs, and times each.

    PYTHONPATH=. python3 bench/capture_repeat.py --m 8 32 --out bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compiled_rank_block, decode_inputs  # noqa: E402
from bench.common import capture_graph, environment, replay_ms, write_results  # noqa: E402


def _capture_us(step, num_sets: int, replays: int) -> float:
    graph = capture_graph(step, num_sets)
    return statistics.median(replay_ms(graph) / num_sets for _ in range(replays)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--captures", type=int, default=6)
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args()
    block, base, fused, _ = compiled_rank_block()
    rows = []
    for m in args.m:
        xs = decode_inputs(block, m)
        for variant, fn in (("compiled + fused", fused), ("compiled", base)):
            for num_sets in (1, 4):
                times = [_capture_us(lambda i, fn=fn: fn(xs[i]), num_sets, args.replays) for _ in range(args.captures)]
                rows.append({"M": m, "variant": variant, "calls_per_graph": num_sets,
                             "us_per_capture": ", ".join(f"{t:.1f}" for t in times),
                             "first_us": times[0], "median_us": statistics.median(times),
                             "spread_pct": 100 * (max(times) - min(times)) / statistics.median(times)})
                print(rows[-1], flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, router GEMM bf16 (bench/block.py)",
        "timing": f"each capture: median of {args.replays} replays (per call); captures one after the other",
    }
    write_results("capture_repeat", rows, ["M", "variant", "calls_per_graph", "us_per_capture", "first_us",
                                           "median_us", "spread_pct"], meta, args.out)


if __name__ == "__main__":
    main()
