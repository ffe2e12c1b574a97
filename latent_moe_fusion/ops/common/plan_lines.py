"""The plans' lines (ops/routed/routed_plan.py, ops/tail/tail_plan.py): one decision per line with its reason, then
what the plan assumed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    name: str
    value: str
    reason: str


def plan_lines(decisions: Sequence[Decision], assumptions: Sequence[str]) -> list[str]:
    """`name  value  (reason)` per decision, then `assumes  text` per assumption, names in one column."""
    width = max(len(d.name) for d in decisions)
    out = [f"{d.name:<{width}}  {d.value}  ({d.reason})" for d in decisions]
    return out + [f"{'assumes':<{width}}  {a}" for a in assumptions]
