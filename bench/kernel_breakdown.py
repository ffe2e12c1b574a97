"""Where a forward's GPU time goes: CUDA kernel time per kernel name, from the PyTorch profiler.

Run outside CUDA graphs (a replayed graph shows as one opaque launch), so the sum is kernel time,
not wall time: launch gaps are what the graph-replay figures add on top.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def profiled_kernels(fn: Callable[[], Any], iters: int = 5) -> list[tuple[str, float, float]]:
    """[(kernel name, launches per call, µs per call)] of every GPU kernel (and memcpy / memset) of fn(), slowest
    first: one warm-up call, then `iters` calls under the profiler."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        us = evt.self_cuda_time_total if us is None else us
        if us > 0:
            rows.append((evt.key, evt.count / iters, us / iters))
    return sorted(rows, key=lambda row: -row[2])


def kernel_times_us(fn: Callable[[], Any], iters: int = 5, top: int = 8) -> list[tuple[str, float]]:
    """[(kernel name, µs per call)] for the `top` kernels by time, plus ("(other kernels)", µs) and
    ("(all kernels)", µs)."""
    ranked = [(name, us) for name, _, us in profiled_kernels(fn, iters)]
    rest = sum(us for _, us in ranked[top:])
    return ranked[:top] + [("(other kernels)", rest), ("(all kernels)", sum(us for _, us in ranked))]


def breakdown_markdown(sections: dict[str, list[tuple[str, float]]]) -> str:
    lines = []
    for title, rows in sections.items():
        lines += [f"### {title}", "", "| kernel | us per call |", "|---|---|"]
        lines += [f"| `{name[:90]}` | {us:.1f} |" for name, us in rows]
        lines.append("")
    return "\n".join(lines)
