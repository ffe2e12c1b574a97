"""bench/block_targets.py on CPU: each target solved for one part lands exactly on the target, and the table is
derived from a block.py JSON (the committed one and a made-up one) with the right target per size."""

import json
import sys
from pathlib import Path
from unittest import mock

import pytest

from bench import block_targets
from bench.block_targets import Requirement, floor_requirements, ratio_requirements, target_rows, verdict

ROOT = Path(__file__).resolve().parent.parent


def _ratio(routed, compiled_rest, fused_rest):
    return (routed + compiled_rest) / (routed + fused_rest)


@pytest.mark.parametrize("compiled_rest, fused_rest, routed, target", [
    (91.9, 52.1, 176.4, 1.3),  # M = 32-like: the routed op would have to beat its floor
    (86.8, 43.1, 94.7, 1.3),  # M = 8-like: met as measured
    (1172.0, 1104.0, 1819.0, 1.15),  # M = 4096-like: no routed speed reaches it
])
def test_each_requirement_lands_on_the_target(compiled_rest, fused_rest, routed, target):
    by_routed, by_rest = ratio_requirements(compiled_rest, fused_rest, routed, target, routed_floor_us=10.0,
                                            serial_floor_us=5.0)
    assert _ratio(routed, compiled_rest, by_rest.needed_us) == pytest.approx(target)
    if compiled_rest > target * fused_rest:
        assert _ratio(by_routed.needed_us, compiled_rest, fused_rest) == pytest.approx(target)
        # a faster routed op than needed gives more, a slower one less: the ratio falls with the shared part
        assert _ratio(0.9 * by_routed.needed_us, compiled_rest, fused_rest) > target
        assert _ratio(1.1 * by_routed.needed_us, compiled_rest, fused_rest) < target
    else:
        assert by_routed.needed_us is None and not by_routed.reachable
        assert all(_ratio(r, compiled_rest, fused_rest) < target for r in (0.0, 1.0, routed, 1e6))


def test_floor_requirements_fill_the_allowed_time():
    by_routed, by_rest = floor_requirements(fused_rest_us=52.0, routed_us=176.0, block_floor_us=155.0, target=1.3,
                                            routed_floor_us=120.0, serial_floor_us=30.0)
    assert by_routed.needed_us + 52.0 == pytest.approx(1.3 * 155.0)
    assert by_rest.needed_us + 176.0 == pytest.approx(1.3 * 155.0)
    # 149.5 us of routed op allowed against its 120 us floor; 25.5 us of rest against the projections' 30 us
    assert by_routed.reachable and not by_rest.reachable


def test_verdicts():
    yes, no, never = Requirement(50.0, 40.0), Requirement(30.0, 40.0), Requirement(None, 40.0)
    assert verdict(True, no, no) == "met"
    assert verdict(False, yes, no) == "reachable by routed op <= 50.0 us"
    assert verdict(False, never, yes) == "reachable by rest <= 50.0 us"
    assert verdict(False, yes, yes) == "reachable by routed op <= 50.0 us or rest <= 50.0 us"
    assert verdict(False, no, never, ceiling=1.4, target=1.3) == "needs both parts to move"
    assert verdict(False, no, no, ceiling=1.25, target=1.3) == "out of reach: ceiling 1.250x"


def _block_row(m, compiled, fused, routed, router_gemm=10.0):
    return {"M": m, "compiled_us": compiled, "compiled+fused_us": fused, "floor_us": 0.6 * fused,
            "untouched_us": routed + router_gemm + 20.0 + 15.0, "router_chain_us": 20.0, "down_projection_us": 15.0,
            "router_gemm_us": router_gemm, "untouched_floor_us": 0.5 * routed, "serial_floor_us": 25.0,
            "ceiling_fused_vs_compiled": 1.4}


def _block_json(rows):
    return {"meta": {"date": "2026-12-01T00:00:00+00:00", "copy_TBps": 4.2, "bf16_TFLOPps": 780.0, "timing": "x"},
            "rows": rows}


def test_rows_take_the_decode_and_prefill_targets():
    rows = target_rows(_block_json([_block_row(8, 180.0, 130.0, 90.0), _block_row(4096, 3000.0, 2900.0, 1800.0)]))
    decode, prefill = rows
    assert decode["routed_us"] == pytest.approx(90.0)
    assert decode["compiled_rest_us"] == pytest.approx(90.0) and decode["fused_rest_us"] == pytest.approx(40.0)
    assert decode["ratio_target"] == 1.3 and decode["ratio_verdict"] == "met"
    assert decode["floor_target"] == 1.3 and decode["floor_verdict"] != "met"  # 130 > 1.3 * 78
    assert prefill["ratio_target"] == 1.15 and prefill["floor_verdict"] == "no target at prefill"
    assert prefill["ratio_routed_needed_us"] == "none"  # 1200 <= 1.15 * 1100: no routed speed reaches 1.15x
    # the routed floor is the untouched floor less the router's (BF16 [896, 7168] weight + FP32 bias)
    router_bytes = 2 * 896 * 7168 + 4 * 896
    assert decode["routed_floor_us"] == pytest.approx(45.0 - router_bytes / 4.2e12 * 1e6)


def test_the_committed_block_run_gives_a_row_per_size(tmp_path):
    source = ROOT / "bench" / "results" / "block.json"
    block_json = json.loads(source.read_text())
    with mock.patch.object(sys, "argv", ["block_targets.py", "--out", str(tmp_path), "--block", str(source)]):
        block_targets.main()
    written = json.loads((tmp_path / "block_targets.json").read_text())
    assert [r["M"] for r in written["rows"]] == [r["M"] for r in block_json["rows"]]
    for row in written["rows"]:
        assert 0 < row["routed_us"] < row["compiled_us"] and 0 < row["routed_floor_us"] < row["routed_us"]
        assert row["fused_vs_compiled"] == pytest.approx(row["compiled_us"] / row["fused_us"])
    assert "| M |" in (tmp_path / "block_targets.md").read_text()


def test_a_missing_block_run_says_what_to_run(tmp_path):
    with mock.patch.object(sys, "argv", ["block_targets.py", "--out", str(tmp_path)]), \
            pytest.raises(SystemExit, match="run bench/block.py"):
        block_targets.main()
