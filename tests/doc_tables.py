"""Reading the Markdown tables of README.md and docs/ and the benchmark JSON they quote: the doc tests check every
shown figure against the committed result it names, rounded to the digits shown."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def table(doc: str, header_start: str) -> list[list[str]]:
    """The body rows (cells) of the one table in `doc` (a path under the repository) whose header line starts with
    header_start."""
    lines = (ROOT / doc).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(header_start)]
    assert len(starts) == 1, f"{doc} has {len(starts)} tables starting {header_start!r}"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell)


def agrees(shown: str, value: float) -> bool:
    """`shown` is `value` rounded to the digits it shows (6.1e-08: to 1e-9)."""
    half_unit = float(Decimal(1).scaleb(Decimal(shown).as_tuple().exponent)) / 2
    return abs(float(shown) - value) <= half_unit * (1 + 1e-9)


def result(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def rows_by(name: str, *keys: str) -> dict:
    """The result's rows keyed by the values of `keys` (one key: the bare value)."""
    rows = result(name)["rows"]
    return {(row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)): row for row in rows}


def check_cells(where: str, cells: list[str], values: list[float]) -> None:
    """Each cell's first number is its value, rounded to the digits shown."""
    for cell, value in zip(cells, values, strict=True):
        shown = numbers(cell)
        assert shown, f"{where}: no figure in {cell!r}"
        assert agrees(shown[0], value), f"{where}: {cell} against {value:.4g}"


BLOCK_COLUMNS = ["floor_us", "serving_us", "compiled_us", "compiled+fused_us", "fused_vs_serving", "fused_vs_compiled",
                 "fused_x_floor"]
BLOCK_HEADER = ("| M | floor us | serving us | compiled us | compiled + fused us | fused / serving | fused / compiled | "
                "fused x floor |")


def check_block_table(doc: str) -> None:
    """The headline block table of `doc` is block.json, row by row."""
    measured = rows_by("block", "M")
    rows = table(doc, BLOCK_HEADER)
    assert [int(r[0]) for r in rows] == sorted(measured), f"{doc}: the block table's M are not block.json's"
    for cells in rows:
        row = measured[int(cells[0])]
        check_cells(f"{doc} block M = {cells[0]}", cells[1:], [row[k] for k in BLOCK_COLUMNS])
