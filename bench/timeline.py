"""GPU idle time of one forward, read from a PyTorch profiler (Kineto) chrome trace.

Kernel-time sums (kernel_breakdown.py) say where GPU time goes; they cannot say why a forward takes
longer than its kernels. This module finds the intervals in which no kernel, copy or memset ran
between a forward's first and last GPU activity, and for each such gap names what the host was doing
when it finally launched the work that ended it (the enclosing host ops) and whether the host had
synchronised with the device since the previous launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Runtime calls that block the host until the device (or a stream / event) has caught up.
# Exact names: cudaMemcpyAsync, cudaMemcpy's asynchronous twin, is not one.
SYNC_CALLS = frozenset(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2"))
HOST_OP_CATEGORIES = ("cpu_op", "python_function")
# Launches and syncs: the runtime API, and the driver API that Triton and CuTe DSL launch through.
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Gap:
    """An interval in which the GPU ran nothing, in microseconds of the trace's clock."""

    start_us: float
    end_us: float
    next_gpu_op: str
    host_ops: tuple[str, ...]  # host ops enclosing the launch that ended the gap, outermost first
    after_sync: bool  # the host synchronised between the previous launch and this one

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class ForwardTimeline:
    """GPU span, busy and idle time of one forward, and its gaps (longest first)."""

    span_us: float
    busy_us: float
    gaps: list[Gap] = field(default_factory=list)
    sync_calls: int = 0

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def merged_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals, sorted and non-overlapping."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _is_sync(name: str) -> bool:
    return name in SYNC_CALLS


def _enclosing(host_ops: Sequence[dict[str, Any]], t: float, depth: int) -> tuple[str, ...]:
    around = [op for op in host_ops if op["ts"] <= t <= op["ts"] + op["dur"]]
    around.sort(key=lambda op: -op["dur"])  # outermost first
    names: list[str] = []
    for op in around:
        if op["name"] not in names:
            names.append(op["name"])
    if len(names) <= depth:
        return tuple(names)
    return tuple(names[:1] + names[-(depth - 1):])  # the outermost and the innermost ones


def forward_timeline(events: Sequence[dict[str, Any]], window_name: str, min_gap_us: float = 2.0,
                     host_depth: int = 4) -> ForwardTimeline:
    """Timeline of the forward marked by the host range named `window_name` (a record_function).

    GPU work belongs to the forward when its launching runtime call (same correlation id) lies inside
    that host range, so work of neighbouring forwards never counts.
    """
    window = next((e for e in events if e.get("name") == window_name and e.get("ph") == "X"
                   and e.get("cat") == "user_annotation"), None)
    if window is None:
        raise ValueError(f"no host range named {window_name!r} in the trace: wrap the forward in "
                         f"torch.profiler.record_function({window_name!r})")
    w0, w1 = window["ts"], window["ts"] + window["dur"]
    runtime = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES and e.get("ph") == "X" and w0 <= e["ts"] <= w1]
    launch_by_corr = {e["args"].get("correlation"): e for e in runtime if "correlation" in e.get("args", {})}
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"
         and e.get("args", {}).get("correlation") in launch_by_corr),
        key=lambda e: e["ts"],
    )
    if not gpu:
        return ForwardTimeline(span_us=0.0, busy_us=0.0)
    busy = merged_intervals((e["ts"], e["ts"] + e["dur"]) for e in gpu)
    host_ops = [e for e in events if e.get("cat") in HOST_OP_CATEGORIES and e.get("ph") == "X"
                and e["ts"] < w1 and e["ts"] + e["dur"] > w0]
    syncs = sorted(e["ts"] for e in runtime if _is_sync(e["name"]))
    gaps = []
    for (_, prev_end), (next_start, _) in zip(busy, busy[1:], strict=False):
        if next_start - prev_end < min_gap_us:
            continue
        first = next(e for e in gpu if e["ts"] >= next_start)
        launch = launch_by_corr[first["args"]["correlation"]]
        prev_launches = [launch_by_corr[e["args"]["correlation"]]["ts"] for e in gpu if e["ts"] + e["dur"] <= prev_end]
        since = max(prev_launches) if prev_launches else w0
        gaps.append(Gap(
            start_us=prev_end, end_us=next_start, next_gpu_op=first["name"],
            host_ops=_enclosing(host_ops, launch["ts"], host_depth),
            after_sync=any(since <= t <= launch["ts"] for t in syncs),
        ))
    gaps.sort(key=lambda g: -g.us)
    return ForwardTimeline(
        span_us=busy[-1][1] - busy[0][0],
        busy_us=sum(e - s for s, e in busy),
        gaps=gaps,
        sync_calls=len(syncs),
    )
