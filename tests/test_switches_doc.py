"""docs/switches.md names every environment variable the package reads, once, and nothing it does not read."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"LMF_[A-Z0-9_]*[A-Z0-9]")
FAMILY = "LMF_BACKEND_"  # LMF_BACKEND_<OP>: read as an f-string, documented as the family and its members


def _read_by_package() -> set[str]:
    names = set()
    for path in (ROOT / "latent_moe_fusion").rglob("*.py"):
        names |= set(NAME.findall(path.read_text()))
    return names


def _documented() -> tuple[list[str], set[str]]:
    """(the variables heading table rows, every LMF_ name the file mentions)."""
    text = (ROOT / "docs" / "switches.md").read_text()
    heads = [m.group(1) for m in re.finditer(r"^\| `(LMF_[^`]+)`", text, flags=re.MULTILINE)]
    return heads, set(NAME.findall(text))


def test_every_variable_the_package_reads_is_documented():
    heads, mentioned = _documented()
    missing = sorted(n for n in _read_by_package() if n not in mentioned)
    assert not missing, f"docs/switches.md does not name {missing}: add a row for each"
    assert len(heads) == len(set(heads)), f"a variable heads two rows: {sorted(h for h in heads if heads.count(h) > 1)}"


def test_every_documented_variable_is_read():
    read = _read_by_package()
    _, mentioned = _documented()
    stale = sorted(n for n in mentioned if n not in read and not n.startswith(FAMILY))
    assert not stale, f"docs/switches.md names {stale}, which the package no longer reads"
