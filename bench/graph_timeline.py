"""Kernel timeline of a replayed CUDA graph: when each kernel starts, how long it runs, on which stream.

Graph-replay timings (block.py) say how long a decode forward takes; per-kernel sums (kernel_breakdown.py)
say which kernels take time but not which ones sit on the critical path, and they are taken outside
graphs. This profiles a few replays of one captured forward (CUPTI records the graph's kernels one by
one), lines the replays up by kernel position and reports, per kernel, its median start and duration
relative to the replay's first kernel and the idle time before it (no kernel running on any stream).

    PYTHONPATH=. python3 bench/graph_timeline.py --m 1 8 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class KernelRow:
    """One kernel of a replay, medians over the replays (times in us from the replay's first kernel)."""

    name: str
    stream: int
    start_us: float
    dur_us: float
    idle_before_us: float  # nothing ran on any stream between the previous kernels' end and this start


def split_replays(events: Sequence[dict[str, Any]], min_pause_us: float = 30.0) -> list[list[dict[str, Any]]]:
    """Kernel events grouped into replays: by the correlation id of the graph launch that ran them (every
    kernel of one replay carries its cudaGraphLaunch's), else by pauses of at least `min_pause_us` with
    no kernel running (the host synchronises between replays)."""
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"] for e in events if e.get("name") == "cudaGraphLaunch"
                and "correlation" in e.get("args", {})}
    if launches and all(e.get("args", {}).get("correlation") in launches for e in kernels):
        by_launch: dict[int, list[dict[str, Any]]] = {}
        for e in kernels:
            by_launch.setdefault(e["args"]["correlation"], []).append(e)
        return sorted(by_launch.values(), key=lambda r: r[0]["ts"])
    replays: list[list[dict[str, Any]]] = []
    busy_until = float("-inf")
    for e in kernels:
        if e["ts"] - busy_until >= min_pause_us:
            replays.append([])
        replays[-1].append(e)
        busy_until = max(busy_until, e["ts"] + e["dur"])
    return replays


def replay_rows(replays: Sequence[Sequence[dict[str, Any]]]) -> list[KernelRow]:
    """Per kernel position, the median over the replays that launched the same kernels (the most common
    sequence of names; a replay that differs, e.g. the profiler's own warm-up, is left out)."""
    if not replays:
        return []
    signatures = [tuple(e["name"] for e in r) for r in replays]
    common = max(set(signatures), key=signatures.count)
    chosen = [r for r, sig in zip(replays, signatures, strict=True) if sig == common]
    rows = []
    for i, name in enumerate(common):
        starts, durs, idles = [], [], []
        for r in chosen:
            t0 = r[0]["ts"]
            e = r[i]
            ended_before = max((p["ts"] + p["dur"] for p in r[:i]), default=e["ts"])
            starts.append(e["ts"] - t0)
            durs.append(e["dur"])
            idles.append(max(0.0, e["ts"] - ended_before))
        rows.append(KernelRow(name, int(r[i].get("args", {}).get("stream", -1)), statistics.median(starts),
                              statistics.median(durs), statistics.median(idles)))
    return rows


def summary(rows: Sequence[KernelRow]) -> dict[str, float]:
    """Span of the replay, time some kernel ran, and the idle rest."""
    if not rows:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0}
    from bench.timeline import merged_intervals

    busy = merged_intervals((r.start_us, r.start_us + r.dur_us) for r in rows)
    span = max(r.start_us + r.dur_us for r in rows) - min(r.start_us for r in rows)
    busy_us = sum(e - s for s, e in busy)
    return {"span_us": span, "busy_us": busy_us, "idle_us": span - busy_us}


def rows_markdown(rows: Sequence[KernelRow]) -> str:
    lines = ["| # | stream | kernel | start us | us | idle before us |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {r.stream} | `{r.name[:70]}` | {r.start_us:.1f} | {r.dur_us:.1f} | {r.idle_before_us:.1f} |"
              for i, r in enumerate(rows)]
    return "\n".join(lines)


def profile_graph(step: Callable[[], Any], replays: int = 12) -> list[KernelRow]:
    """Capture step() in a CUDA graph, profile `replays` synchronised replays, return the kernel rows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return replay_rows(split_replays(events))


def main() -> None:
    import torch

    from bench.block import compiled_rank_block
    from bench.common import environment, knobs_applied, parse_knobs

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--name", default="graph_timeline")
    ap.add_argument("--fused-knobs", nargs="*", default=[], metavar="KNOB=VALUE",
                    help="also profile the fused block with each of these settings (a tuning override field, e.g. "
                         "pdl_sites=tail, or an LMF_ variable)")
    args = ap.parse_args()
    block, base, fused, _ = compiled_rank_block()
    # (forward, knobs while capturing): PDL's sites are read per call, so one compile serves both
    variants = {"compiled": (base, {}), "compiled+fused": (fused, {}),
                "compiled+fused, pdl_sites=none": (fused, {"pdl_sites": "none"})}
    for spec in args.fused_knobs:
        variants[f"compiled+fused, {spec}"] = (fused, parse_knobs([spec], "--fused-knobs"))
    meta = environment()
    out: dict[str, Any] = {"meta": meta, "timelines": {}}
    text = [f"# {args.name}: kernels of one replayed forward\n",
            f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; Kimi K3 rank "
            "(TP8/EP8, MXFP4 experts, router GEMM bf16). Medians over 12 profiled replays of one CUDA graph; "
            "times from the replay's first kernel; profiling adds little inside a graph but the absolute span "
            "is not the benchmark figure (block.md).\n"]
    for m in args.m:
        x = torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        for name, (fn, knobs) in variants.items():
            with knobs_applied(knobs):
                rows = profile_graph(lambda fn=fn: fn(x))
            key = f"M = {m}, {name}"
            s = summary(rows)
            out["timelines"][key] = {"summary": s, "kernels": [r.__dict__ for r in rows]}
            text += [f"\n### {key}: span {s['span_us']:.1f} us, busy {s['busy_us']:.1f}, idle {s['idle_us']:.1f}\n",
                     rows_markdown(rows)]
            print(key, s, flush=True)
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    (dest / f"{args.name}.md").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
