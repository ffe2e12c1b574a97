"""Environment switches the ops read per call (A/B knobs for the benchmarks, overrides for users): one
parser for "one of these words", one for "0 / 1" and one for "these words in some order", so that every knob
refuses an unknown value the same way, naming the variable and what it accepts."""

from __future__ import annotations

import os
from collections.abc import Sequence


def env_choice(name: str, choices: Sequence[str], meaning: str = "") -> str | None:
    """The value of `name` when set (one of `choices`), None when unset or empty. `meaning` (e.g. "the branch
    launched first") goes into the error for an unknown value."""
    value = os.environ.get(name, "")
    if not value:
        return None
    if value not in choices:
        what = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(choices)}{what} or unset")
    return value


def env_switch(name: str, on: str, off: str) -> bool | None:
    """True for "1", False for "0", None when unset or empty; `on` / `off` say what each does, for the error."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: expected 1 ({on}), 0 ({off}) or unset")
    return None if not value else value == "1"


def env_permutation(name: str, items: Sequence[str], what: str = "the items") -> tuple[str, ...] | None:
    """The value of `name` when set: every one of `items` once, comma-separated, in the order given; None when
    unset or empty. `what` names the items in the error for any other value."""
    value = os.environ.get(name, "")
    if not value:
        return None
    order = tuple(v.strip() for v in value.split(","))
    if sorted(order) != sorted(items):
        raise ValueError(f"{name}={value!r}: expected {what} {', '.join(items)}, each once, comma-separated, "
                         "or unset")
    return order
