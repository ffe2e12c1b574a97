"""Kernel-by-kernel GPU time of one forward, from the PyTorch profiler (outside CUDA graphs: a replayed graph shows
as one launch), for bench/peer_routed.py --profile: where the peer's time goes against ours.

Unlike bench/kernel_breakdown.py's kernel_times_us this keeps every kernel and its launch count per forward: the peer's per-call
routing metadata is several small kernels whose count matters as much as their time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.kernel_breakdown import profiled_kernels

KernelRow = tuple[str, float, float]  # (kernel name, launches per forward, us per forward)


def kernel_table(fn: Callable[[], Any], iters: int = 5) -> list[KernelRow]:
    """Every GPU kernel (and memcpy / memset) of fn(), by time per forward, then a total row."""
    rows = profiled_kernels(fn, iters)
    return rows + [("(all kernels)", sum(r[1] for r in rows), sum(r[2] for r in rows))]


def table_markdown(sections: dict[str, list[KernelRow]]) -> str:
    lines = []
    for title, rows in sections.items():
        lines += [f"### {title}", "", "| kernel | calls | us per forward |", "|---|---|---|"]
        lines += [f"| `{name[:110]}` | {calls:g} | {us:.1f} |" for name, calls, us in rows]
        lines.append("")
    return "\n".join(lines)
