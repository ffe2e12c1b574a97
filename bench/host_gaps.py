"""Where the block's wall time exceeds its kernel time outside CUDA graphs (prefill): GPU idle gaps.

For each size and variant (compiled, compiled + fused), with the routed ops' id check on and off
(`LMF_CHECK_IDS`, read per call), profiles a few forwards and reports from the trace (bench/timeline.py):
the GPU span of a forward, the time some kernel ran, the idle rest, host syncs, and the longest gaps
with the GPU work that ended them and the host ops that launched it. Profiling adds host time per op,
so the idle figures are upper bounds of an unprofiled run; the wall times beside them are unprofiled
(CUDA events, alternating rounds).

    PYTHONPATH=. python3 bench/host_gaps.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compiled_rank_block  # noqa: E402
from bench.common import environment, time_interleaved_ms, write_results  # noqa: E402
from bench.timeline import forward_timeline  # noqa: E402
from latent_moe_fusion.model.router import ROUTER_GEMMS  # noqa: E402
from latent_moe_fusion.ops.routed.expert_ids_check import CHECK_IDS_ENV  # noqa: E402


def profiled_timelines(fn, x: torch.Tensor, forwards: int):
    from torch.profiler import ProfilerActivity, profile, record_function

    fn(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(forwards):
            with record_function(f"forward#{i}"):
                fn(x)
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return [forward_timeline(events, f"forward#{i}") for i in range(forwards)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[4096])
    ap.add_argument("--forwards", type=int, default=3)
    ap.add_argument("--router-gemm", choices=ROUTER_GEMMS, default="bf16")
    args = ap.parse_args()
    block, base, fused, _ = compiled_rank_block(args.router_gemm)
    variants = {"compiled": base, "compiled+fused": fused}
    rows, gap_lines = [], []
    for m in args.m:
        x = torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        for check in ("1", "0"):
            os.environ[CHECK_IDS_ENV] = check
            walls = time_interleaved_ms({name: lambda fn=fn: fn(x) for name, fn in variants.items()})
            for name, fn in variants.items():
                timelines = profiled_timelines(fn, x, args.forwards)
                mid = sorted(timelines, key=lambda t: t.idle_us)[len(timelines) // 2]
                rows.append({
                    "M": m, "variant": name, "check_ids": check, "wall_us": walls[name] * 1e3,
                    "span_us": statistics.median(t.span_us for t in timelines),
                    "busy_us": statistics.median(t.busy_us for t in timelines),
                    "idle_us": statistics.median(t.idle_us for t in timelines),
                    "gaps_over_2us": len(mid.gaps), "host_syncs": mid.sync_calls,
                })
                print(rows[-1], flush=True)
                gap_lines.append(f"\n### M = {m}, {name}, {CHECK_IDS_ENV}={check} (forward with the median idle time)\n")
                gap_lines.append("| gap us | GPU work that ended it | host ops launching it | after a host sync |")
                gap_lines.append("|---|---|---|---|")
                for gap in mid.gaps[:6]:
                    gap_lines.append(f"| {gap.us:.1f} | `{gap.next_gpu_op[:60]}` | {' > '.join(gap.host_ops)[:120]} "
                                     f"| {'yes' if gap.after_sync else 'no'} |")
    os.environ.pop(CHECK_IDS_ENV, None)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8 (bench/block.py), router GEMM " + args.router_gemm,
        "wall": "unprofiled, CUDA events, median of alternating rounds",
        "span/busy/idle": f"profiled (adds host time), median over {args.forwards} forwards; idle = span - busy",
    }
    cols = ["M", "variant", "check_ids", "wall_us", "span_us", "busy_us", "idle_us", "gaps_over_2us", "host_syncs"]
    write_results("host_gaps", rows, cols, meta, args.out, notes="## Longest gaps\n" + "\n".join(gap_lines))


if __name__ == "__main__":
    main()
