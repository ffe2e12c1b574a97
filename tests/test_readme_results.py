"""The README's headline tables say what the committed results say: the block table is bench/results/block.json, the
targets table block_targets.json, the tail table tail_cute.json and the router chain table route.json, each figure
rounded to the digits the README shows. A new `make bench` run fails this until the README is brought in step."""

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _table(header_start: str) -> list[list[str]]:
    """The body rows (cells) of the README table whose header line starts with header_start."""
    lines = (ROOT / "README.md").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header_start)]
    assert len(starts) == 1, f"README has {len(starts)} tables starting {header_start!r}"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell)


def _agrees(shown: str, value: float) -> bool:
    """`shown` is `value` rounded to the digits it shows (6.1e-08: to 1e-9)."""
    half_unit = float(Decimal(1).scaleb(Decimal(shown).as_tuple().exponent)) / 2
    return abs(float(shown) - value) <= half_unit * (1 + 1e-9)


def _rows_by_m(name: str) -> dict[int, dict]:
    return {row["M"]: row for row in json.loads((RESULTS / f"{name}.json").read_text())["rows"]}


def test_block_table_is_block_json():
    measured = _rows_by_m("block")
    columns = ["eager_us", "compiled_us", "compiled+fused_us", "floor_us", "fused_vs_compiled", "fused_x_floor",
               "ceiling_fused_vs_compiled"]
    rows = _table("| M | eager us | compiled us | compiled + fused us |")
    assert [int(r[0]) for r in rows] == sorted(measured)
    for cells in rows:
        row = measured[int(cells[0])]
        for key, cell in zip(columns, cells[1:], strict=True):
            (shown,) = _numbers(cell)
            assert _agrees(shown, row[key]), f"README M = {cells[0]} {key}: {cell} against {row[key]:.4g}"


@pytest.mark.parametrize("column, keys", [
    (1, ("fused_vs_compiled", "ratio_target")),
    (2, ("fused_x_floor",)),
    (3, ("routed_us", "routed_floor_us")),
    (4, ("compiled_rest_us", "fused_rest_us", "serial_floor_us")),
])
def test_targets_table_is_block_targets_json(column, keys):
    derived = _rows_by_m("block_targets")
    rows = _table("| M | fused / compiled (target) |")
    assert [int(r[0]) for r in rows] == sorted(derived)
    for cells in rows:
        row = derived[int(cells[0])]
        shown = _numbers(cells[column])[: len(keys)]
        assert len(shown) == len(keys), f"README M = {cells[0]}: {cells[column]!r} lacks figures for {keys}"
        for key, figure in zip(keys, shown, strict=True):
            assert _agrees(figure, row[key]), f"README M = {cells[0]} {key}: {figure} against {row[key]:.4g}"


def test_block_targets_json_is_derived_from_block_json():
    """block_targets.json was made from the block.json the README's block table shows (same run)."""
    block_meta = json.loads((RESULTS / "block.json").read_text())["meta"]
    targets_meta = json.loads((RESULTS / "block_targets.json").read_text())["meta"]
    assert targets_meta["date"] == block_meta["date"], "re-run bench/block_targets.py after bench/block.py"


def test_tail_table_is_tail_cute_json():
    measured = {(r["M"], r["R"]): r for r in json.loads((RESULTS / "tail_cute.json").read_text())["rows"]}
    rows = _table("| M | R | unfused (cuBLAS mm + FP32 sum + add) us |")
    assert rows
    for cells in rows:
        row = measured[int(cells[0]), int(cells[1])]
        best = min(row["triton_us"], row["cute_us"]) / row["floor_us"]
        for value, cell in zip((row["unfused_us"], row["triton_us"], row["cute_us"], row["floor_us"], best), cells[2:],
                               strict=True):
            assert _agrees(cell, value), f"README tail M = {cells[0]} R = {cells[1]}: {cell} against {value:.4g}"


def test_router_chain_table_is_route_json():
    measured = _rows_by_m("route")
    columns = ["eager_us", "compiled_us", "compiled+fused_us", "fused_vs_compiled", "floor_us", "one_kernel_us"]
    rows = _table("| M | eager us | compiled us | fused us | fused / compiled | floor us | one kernel us |")
    assert [int(r[0]) for r in rows] == sorted(measured)
    for cells in rows:
        row = measured[int(cells[0])]
        for key, cell in zip(columns, cells[1:7], strict=True):
            (shown,) = _numbers(cell)
            assert _agrees(shown, row[key]), f"README router M = {cells[0]} {key}: {cell} against {row[key]:.4g}"
        assert (cells[7] == "yes") is row["ids_equal_compiled"], f"README router M = {cells[0]}: ids {cells[7]}"
        weights = row["weights_rel_l2_vs_compiled"]
        assert _agrees(cells[8], weights), f"README router M = {cells[0]} weights: {cells[8]} against {weights:.4g}"
