"""The README's headline table (the Kimi K3 block at decode and prefill against its floor) says what
bench/results/block.json says, each figure rounded to the digits shown. A new `make bench` run fails this until the
README is brought in step; docs/results.md's tables are checked by test_results_doc.py."""

import pytest

from tests.doc_tables import BLOCK_HEADER, check_block_table


def test_block_table_is_block_json():
    check_block_table("README.md")


def test_a_drifted_figure_fails(tmp_path, monkeypatch):
    """The check really compares: the README with one figure changed fails it."""
    from tests import doc_tables

    text = (doc_tables.ROOT / "README.md").read_text()
    start = text.index(BLOCK_HEADER)
    row = text.index("\n| 8 |", start) + 1
    end = text.index("\n", row)
    cells = text[row:end].split("|")
    cells[4] = f" {float(cells[4]) + 1.0:.1f} "  # compiled us at M = 8
    (tmp_path / "README.md").write_text(text[:row] + "|".join(cells) + text[end:])
    monkeypatch.setattr(doc_tables, "ROOT", tmp_path)
    with pytest.raises(AssertionError, match="compiled|M = 8"):
        check_block_table("README.md")
