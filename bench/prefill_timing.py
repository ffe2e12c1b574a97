"""How to time the prefill block (M = 4096, no CUDA graph): one synchronised call per sample, or calls back to back.

Outside a CUDA graph the host's time before a call's first launch (Dynamo's guards, Inductor's wrapper, the
ops' Python) counts fully in a synchronised single call, but in a model it overlaps the GPU work of the layers
before. This times the same compiled graphs both ways in one process, in two variant orders, with two
separate compiles of the same fused graph (`fused` and `fused again`, which must time alike), and the host
time per call. `--precompile` first compiles the decode sizes too (as bench/block.py does), which adds cache
entries to the block's code object.

    PYTHONPATH=. python3 bench/prefill_timing.py --out bench/results [--precompile 1 8 32 128 --name NAME]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compile_afresh, compiled, kimi_rank_block  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    host_us,
    time_back_to_back_interleaved_ms,
    time_interleaved_ms,
    write_results,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--precompile", type=int, nargs="*", default=[], help="decode sizes to compile first")
    ap.add_argument("--name", default="prefill_timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    compile_afresh()
    block = kimi_rank_block("bf16")
    variants = {"compiled": compiled(block, False)[0], "fused": compiled(block, True)[0],
                "fused again": compiled(block, True)[0]}
    for m in args.precompile:
        x = torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        for fn in variants.values():
            fn(x)
    x = torch.randn(args.m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    fns = {name: (lambda fn=fn: fn(x)) for name, fn in variants.items()}
    reverse = dict(reversed(list(fns.items())))
    timings = {
        "single call, order A": time_interleaved_ms(fns),
        "single call, order B": time_interleaved_ms(reverse),
        "back to back x4, order A": time_back_to_back_interleaved_ms(fns),
        "back to back x4, order B": time_back_to_back_interleaved_ms(reverse),
    }
    rows = []
    for how, medians in timings.items():
        row = {"M": args.m, "timing": how} | {f"{name} us": ms * 1e3 for name, ms in medians.items()}
        row["compiled / fused"] = medians["compiled"] / medians["fused"]
        row["fused again / fused"] = medians["fused again"] / medians["fused"]
        rows.append(row)
    rows.append({"M": args.m, "timing": "host us per call"} | {f"{name} us": host_us(fn, calls=6)[0] for name, fn in fns.items()})
    for row in rows:
        print(row, flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, shared 768, R=1, router GEMM bf16",
        "precompiled decode sizes": args.precompile or "none",
        "timing": "single call: CUDA events around one synchronised call, median of 5 alternating rounds of 4; back "
                  "to back: events around 4 calls without a sync between them, median of 5 alternating rounds; "
                  "host: wall time of one call from an idle GPU to its return",
    }
    cols = ["M", "timing", "compiled us", "fused us", "fused again us", "compiled / fused", "fused again / fused"]
    write_results(args.name, rows, cols, meta, args.out)


if __name__ == "__main__":
    main()
