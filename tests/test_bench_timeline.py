"""bench/timeline.py on hand-made Kineto traces: busy time, gaps, their attribution."""

from __future__ import annotations

import pytest

from bench.timeline import forward_timeline, merged_intervals


def _x(cat: str, name: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def _launch(name: str, ts: float, corr: int, cat: str = "cuda_runtime") -> dict:
    return _x(cat, name, ts, 1.0, correlation=corr)


def _kernel(name: str, ts: float, dur: float, corr: int, stream: int = 7) -> dict:
    return _x("kernel", name, ts, dur, correlation=corr, stream=stream)


def test_merged_intervals_joins_overlaps_and_keeps_holes():
    assert merged_intervals([(5, 7), (0, 2), (1, 3), (7, 8), (10, 11)]) == [(0, 3), (5, 8), (10, 11)]
    assert merged_intervals([]) == []


def test_gap_after_a_host_sync_is_found_and_attributed():
    events = [
        _x("user_annotation", "fwd#0", 0.0, 400.0),
        _x("cpu_op", "lmf::routed_experts", 20.0, 300.0),
        _x("cpu_op", "aten::item", 30.0, 80.0),
        _launch("cudaLaunchKernel", 5.0, 1),
        _kernel("router_gemm", 10.0, 50.0, 1),
        _launch("cudaStreamSynchronize", 40.0, 2),
        _launch("cuLaunchKernel", 150.0, 3, cat="cuda_driver"),
        _kernel("l1_kernel", 160.0, 100.0, 3),
        # a second stream overlapping the first: no gap between them
        _launch("cudaLaunchKernel", 155.0, 4),
        _kernel("side_kernel", 200.0, 90.0, 4, stream=9),
        _launch("cudaMemcpyAsync", 291.0, 7),  # asynchronous: not a sync
        _launch("cudaLaunchKernel", 292.0, 5),
        _kernel("tail", 293.0, 5.0, 5),
        # another forward's kernel, outside the host range: ignored
        _launch("cudaLaunchKernel", 500.0, 6),
        _kernel("next_forward", 505.0, 10.0, 6),
    ]
    tl = forward_timeline(events, "fwd#0")
    assert tl.span_us == pytest.approx(298.0 - 10.0)
    assert tl.busy_us == pytest.approx(50.0 + 130.0 + 5.0)
    assert tl.idle_us == pytest.approx(100.0 + 3.0)
    assert tl.sync_calls == 1
    assert [round(g.us) for g in tl.gaps] == [100, 3]
    big = tl.gaps[0]
    assert big.next_gpu_op == "l1_kernel"
    assert big.host_ops == ("lmf::routed_experts",)
    assert big.after_sync
    assert not tl.gaps[1].after_sync


def test_min_gap_filters_short_holes():
    events = [
        _x("user_annotation", "fwd#1", 0.0, 100.0),
        _launch("cudaLaunchKernel", 1.0, 1),
        _kernel("a", 2.0, 10.0, 1),
        _launch("cudaLaunchKernel", 3.0, 2),
        _kernel("b", 13.0, 10.0, 2),
    ]
    tl = forward_timeline(events, "fwd#1", min_gap_us=2.0)
    assert tl.gaps == []
    assert tl.idle_us == pytest.approx(1.0)


def test_missing_window_names_the_fix():
    with pytest.raises(ValueError, match="record_function"):
        forward_timeline([], "fwd#9")
