"""bench/graph_timeline.py on hand-made Kineto kernel events: replays split, lined up, idle time."""

from __future__ import annotations

import pytest

from bench.graph_timeline import replay_rows, split_replays, summary


def _kernel(name: str, ts: float, dur: float, stream: int = 7) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _replay(t0: float, shift: float = 0.0) -> list[dict]:
    # a: main stream; side overlaps b; c starts after a 3 us hole (plus `shift` in this replay)
    return [_kernel("a", t0, 10.0), _kernel("side", t0 + 11.0, 20.0, stream=9), _kernel("b", t0 + 12.0, 5.0),
            _kernel("c", t0 + 34.0 + shift, 4.0)]


def test_replays_are_split_at_pauses_and_lined_up_by_position():
    events = _replay(0.0) + _replay(1000.0, shift=2.0) + _replay(2000.0, shift=1.0)
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5.0, "dur": 2.0})
    replays = split_replays(events)
    assert [len(r) for r in replays] == [4, 4, 4]
    rows = replay_rows(replays)
    assert [r.name for r in rows] == ["a", "side", "b", "c"]
    assert [r.stream for r in rows] == [7, 9, 7, 7]
    assert rows[3].start_us == pytest.approx(35.0)  # median of shifts 0, 2, 1
    assert rows[3].idle_before_us == pytest.approx(4.0)  # side ends at 31
    assert rows[1].idle_before_us == pytest.approx(1.0)
    assert rows[2].idle_before_us == 0.0  # b starts while side runs
    s = summary(rows)
    assert s["span_us"] == pytest.approx(39.0)
    assert s["busy_us"] == pytest.approx(10.0 + 20.0 + 4.0)
    assert s["idle_us"] == pytest.approx(5.0)


def test_a_replay_with_other_kernels_is_left_out():
    odd = [_kernel("warmup", 500.0, 3.0)]
    rows = replay_rows(split_replays(_replay(0.0) + odd + _replay(1000.0)))
    assert [r.name for r in rows] == ["a", "side", "b", "c"]
    assert replay_rows([]) == [] and summary([])["span_us"] == 0.0


def test_replays_follow_their_graph_launch_even_without_a_pause():
    events = []
    for corr, t0 in ((11, 0.0), (12, 60.0)):  # replays 20 us apart: too close for the pause rule
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0, "dur": 3.0,
                       "args": {"correlation": corr}})
        for k in _replay(t0):
            k["args"]["correlation"] = corr
            events.append(k)
    replays = split_replays(events)
    assert [len(r) for r in replays] == [4, 4]
    assert len(split_replays([e for e in events if e["name"] != "cudaGraphLaunch"])) == 1
