"""Size thresholds measured on a GPU, shipped as package data: a JSON table beside the code that reads it.

A table file holds one entry per threshold, each with where its number came from:

    {"about": "...",
     "thresholds": {"decode_pairs": {"value": 4096, "unit": "pairs", "decides": "...",
                                     "meta": {"device": "NVIDIA H200", "date": "2026-11-29",
                                              "rule": "...", "source": "docs/design/producer.md"}}, ...}}

The module that decides by size names the entries it reads (load_table's `names`), and keeps a module constant per
entry so that other code and tests read the same names as before. A table that lacks a named entry, holds one nobody
reads, or has an entry that is not a positive int with complete meta raises MeasuredTableError naming the file and the
key at import: an installation without its data must fail loudly rather than choose other kernels.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

ENTRY_KEYS = ("value", "unit", "decides", "meta")
META_KEYS = ("device", "date", "rule", "source")


class MeasuredTableError(ValueError):
    """A measured table that is missing, unreadable or malformed."""


@dataclass(frozen=True)
class Meta:
    device: str  # the GPU it was measured on
    date: str  # ISO date of the commit that introduced or last re-measured the value
    rule: str  # how the number follows from the measurements
    source: str  # the design note or results file (relative to the repository root) that quotes them


@dataclass(frozen=True)
class Threshold:
    name: str
    value: int
    unit: str  # tokens, pairs, rows per expert, ...
    decides: str  # what the size picks on either side of the value
    meta: Meta

    def lines(self) -> list[str]:
        """Two lines: the value and what it decides, then where it came from."""
        m = self.meta
        return [f"{self.name} = {self.value} {self.unit}: {self.decides}",
                f"    {m.device}, {m.date}, {m.source}: {m.rule}"]


@dataclass(frozen=True)
class MeasuredTable:
    path: Path
    entries: Mapping[str, Threshold]  # read-only, in the file's order

    def value(self, name: str) -> int:
        return self.entry(name).value

    def entry(self, name: str) -> Threshold:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"{self.path}: no threshold {name!r}; it has {', '.join(self.entries)}") from None

    def lines(self) -> list[str]:
        return [line for entry in self.entries.values() for line in entry.lines()]


def load_table(path: str | os.PathLike, names: Iterable[str]) -> MeasuredTable:
    """The table at `path`, checked to hold exactly `names`, each entry complete (cached per path and names)."""
    return _load(Path(path), tuple(names))


@functools.cache
def _load(path: Path, names: tuple[str, ...]) -> MeasuredTable:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise MeasuredTableError(f"{path}: measured table missing; it is package data (pyproject.toml "
                                 "[tool.setuptools.package-data]): reinstall the package or restore the file") from None
    except (OSError, ValueError) as exc:
        raise MeasuredTableError(f"{path}: not a readable JSON table ({exc})") from None
    table = data.get("thresholds") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise MeasuredTableError(f"{path}: expected an object with a 'thresholds' object (name -> entry)")
    missing = [n for n in names if n not in table]
    unknown = [n for n in table if n not in names]
    if missing:
        raise MeasuredTableError(f"{path}: missing threshold(s) {', '.join(missing)}; add an entry for each")
    if unknown:
        raise MeasuredTableError(f"{path}: threshold(s) {', '.join(unknown)} are read by no code "
                                 f"(expected {', '.join(names)}); remove them or fix the name")
    entries = {name: _entry(path, name, table[name]) for name in table}
    return MeasuredTable(path, MappingProxyType(entries))


def _entry(path: Path, name: str, raw: Any) -> Threshold:
    where = f"{path}: threshold {name!r}"
    if not isinstance(raw, dict):
        raise MeasuredTableError(f"{where}: expected an object with {', '.join(ENTRY_KEYS)}")
    missing = [k for k in ENTRY_KEYS if k not in raw]
    if missing:
        raise MeasuredTableError(f"{where}: missing {', '.join(missing)}")
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MeasuredTableError(f"{where}: value must be an integer > 0, got {value!r}")
    for key in ("unit", "decides"):
        _text(where, key, raw[key])
    meta = raw["meta"]
    if not isinstance(meta, dict):
        raise MeasuredTableError(f"{where}: meta must be an object with {', '.join(META_KEYS)}")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise MeasuredTableError(f"{where}: meta lacks {', '.join(missing)}")
    for key in META_KEYS:
        _text(where, f"meta.{key}", meta[key])
    try:
        datetime.date.fromisoformat(meta["date"])
    except ValueError:
        raise MeasuredTableError(f"{where}: meta.date must be an ISO date (YYYY-MM-DD), got {meta['date']!r}") from None
    return Threshold(name, value, raw["unit"], raw["decides"], Meta(*(meta[k] for k in META_KEYS)))


def _text(where: str, key: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise MeasuredTableError(f"{where}: {key} must be a non-empty string, got {value!r}")
