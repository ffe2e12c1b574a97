"""Kernel-by-kernel GPU time of one forward, from the PyTorch profiler (outside CUDA graphs: a replayed graph shows
as one launch), for bench/peer_routed.py --profile: where the peer's time goes against ours.

Unlike bench/kernel_breakdown.py this keeps every kernel and its launch count per forward: the peer's per-call
routing metadata is several small kernels whose count matters as much as their time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

KernelRow = tuple[str, float, float]  # (kernel name, launches per forward, us per forward)


def kernel_table(fn: Callable[[], Any], iters: int = 5) -> list[KernelRow]:
    """Every GPU kernel (and memcpy / memset) of fn(), by time per forward, then a total row."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows: list[KernelRow] = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        us = evt.self_cuda_time_total if us is None else us
        if us > 0:
            rows.append((evt.key, evt.count / iters, us / iters))
    rows.sort(key=lambda row: -row[2])
    return rows + [("(all kernels)", sum(r[1] for r in rows), sum(r[2] for r in rows))]


def table_markdown(sections: dict[str, list[KernelRow]]) -> str:
    lines = []
    for title, rows in sections.items():
        lines += [f"### {title}", "", "| kernel | calls | us per forward |", "|---|---|---|"]
        lines += [f"| `{name[:110]}` | {calls:g} | {us:.1f} |" for name, calls, us in rows]
        lines.append("")
    return "\n".join(lines)
