"""Where the producer launches the shared expert's in-line library GEMMs at prefill (M = 4096, Kimi K3 rank block,
no CUDA graph): before the routed grouping ("first", the default from expert_schedule.SHARED_IN_LINE_FIRST_MIN_TOKENS
tokens on) or right after the routed L1 launch ("after_l1", the order before session 22), against the compiled
block without the pass.

One compile per variant; LMF_SHARED_IN_LINE is read per call, so both orders run the same compiled fused graph.
4 calls back to back between CUDA events (the host launches ahead as across a model's layers), median of 9
alternating rounds; host: one call from an idle GPU to its return (median of 10). Outputs of the two orders: bit
for bit (the same kernels on one stream).

    PYTHONPATH=. python3 bench/shared_in_line_order.py --out bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compile_afresh, compiled, kimi_rank_block  # noqa: E402
from bench.common import env_applied, environment, host_us, write_results  # noqa: E402
from latent_moe_fusion.ops.routed.expert_schedule import SHARED_IN_LINE_ENV  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.manual_seed(0)
    compile_afresh()
    block = kimi_rank_block("bf16")
    base, fused = compiled(block, False)[0], compiled(block, True)[0]
    x = torch.randn(args.m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    variants = {"compiled": (base, ""), "fused, shared first": (fused, "first"),
                "fused, shared after L1": (fused, "after_l1")}

    def back_to_back_us(fn, order: str, calls: int = 4) -> float:
        with env_applied({SHARED_IN_LINE_ENV: order}):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn(x)
            end.record()
            torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / calls

    outputs = {}
    for name, (fn, order) in variants.items():
        with env_applied({SHARED_IN_LINE_ENV: order}):
            outputs[name] = fn(x)
        back_to_back_us(fn, order)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, (fn, order) in variants.items() if r % 2 == 0 else reversed(variants.items()):
            samples[name].append(back_to_back_us(fn, order))
    bitwise = torch.equal(outputs["fused, shared first"], outputs["fused, shared after L1"])
    compiled_us = statistics.median(samples["compiled"])
    rows = []
    for name, (fn, order) in variants.items():
        with env_applied({SHARED_IN_LINE_ENV: order}):
            host = host_us(lambda fn=fn: fn(x), calls=10)[0]
        us = statistics.median(samples[name])
        rows.append({"M": args.m, "variant": name, "us": us, "compiled / this": compiled_us / us, "host_us": host,
                     "min_us": min(samples[name]), "max_us": max(samples[name]),
                     "bitwise_other_order": bitwise if name != "compiled" else ""})
        print(rows[-1], flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, shared 768, R=1, router GEMM bf16",
        "timing": f"4 calls back to back between CUDA events, median of {args.rounds} alternating rounds; host: one "
                  "call from an idle GPU to its return, median of 10",
    }
    write_results("shared_in_line_order", rows, ["M", "variant", "us", "compiled / this", "min_us", "max_us",
                                                 "host_us", "bitwise_other_order"], meta, args.out)


if __name__ == "__main__":
    main()
