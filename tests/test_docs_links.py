"""The project refers only to itself, and its documents hold together:

- the design contract is docs/design.md: no file names the brief it came from (an upper-case design file) or
  anything outside the repository (a sibling shared folder, its field notes);
- every relative link in README.md, CHANGELOG.md and docs/ reaches a file that exists (and a heading there, for
  links with an anchor);
- bench/results/ holds only current results, each named after the script that writes it (`<script>.json`,
  `<script>_<what>.md`), never after a session, a run, a date or a commit.

Each check is a function over given files, tested here on the repository and on a made-up violation."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from bench.run_all import BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent
# Spelled in pieces so that this file does not match its own checks.
OUTSIDE_REFERENCES = re.compile("|".join([
    r"DESIGN" + r"\.md",  # the brief; the contract is docs/design.md
    r"\.\./" + r"shared\b", r"/work/" + r"shared\b", r"\bshared/" + r"DESIGN",
    r"FIELD" + r"-NOTES",
]))
HISTORY_NAME = re.compile(r"session|_run\d|_v\d+(?:\.|_)|_[0-9a-f]{7,40}(?:\.|_)|\d{4}-\d{2}-\d{2}|_(?:final|start|old|new)\b")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "build", ".pytest_cache", ".ruff_cache", ".whl", ".dsl-a", ".dsl-b", "debug_dumps"}


def tracked_files() -> list[Path]:
    """The repository's files: git's list where there is one, else every file outside build and cache folders."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]
    return [p for p in ROOT.rglob("*") if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


def outside_references(files: list[Path]) -> list[str]:
    """`file:line: text` for every line of a text file that names the brief or a path outside the repository."""
    found = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # images, binaries
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_REFERENCES.search(line):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {line.strip()}")
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(md: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in md.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def broken_links(markdown_files: list[Path]) -> list[str]:
    """`file: target` for every relative link (http, mailto and code are not checked) whose file, or heading, is missing."""
    broken = []
    for md in markdown_files:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.DOTALL)  # links inside code blocks are code
        for match in LINK.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):
                continue
            path_part, _, anchor = target.partition("#")
            dest = md if not path_part else (md.parent / path_part).resolve()
            if not dest.exists():
                broken.append(f"{md.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{md.name}: {target} (no such heading)")
    return broken


def misnamed_results(names: list[str], scripts: set[str]) -> list[str]:
    """Result file names that carry history, or that no make bench script (nor bench/gpu_check.sh) writes."""
    bad = []
    for name in names:
        stem = name.split(".", 1)[0]
        if HISTORY_NAME.search(name):
            bad.append(f"{name} (named with history)")
        elif not any(stem == s or stem.startswith(s + "_") for s in scripts):
            bad.append(f"{name} (no script of make bench or gpu_check.sh is named {stem.split('_')[0]}...)")
    return bad


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _result_scripts() -> set[str]:
    return {Path(name).stem for name, _, _ in BENCHMARKS} | {"gpu_check"}


def test_nothing_names_the_brief_or_a_path_outside_the_repository():
    found = outside_references(tracked_files())
    assert not found, "cite docs/design.md (and its sections) instead:\n" + "\n".join(found)


def test_every_relative_link_of_the_documents_resolves():
    broken = broken_links(_documents())
    assert not broken, "\n".join(broken)


def test_results_are_named_after_their_scripts_without_history():
    names = sorted(p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_file())
    bad = misnamed_results(names, _result_scripts())
    assert not bad, "\n".join(bad)


def test_each_check_finds_a_violation(tmp_path):
    """The checks above would fail: each finds the violation planted here and passes the clean case."""
    brief = tmp_path / "notes.py"
    brief.write_text('"""See DESIGN' + '.md section 2."""\n')
    sibling = tmp_path / "other.md"
    sibling.write_text("as ../" + "shared/tools says\n")
    clean = tmp_path / "clean.md"
    clean.write_text("The contract is docs/design.md, section 2.\n")
    assert len(outside_references([brief, sibling, clean])) == 2

    (tmp_path / "there.md").write_text("# A heading\n")
    links = tmp_path / "links.md"
    links.write_text("[ok](there.md) [ok](there.md#a-heading) [web](https://example.com) [gone](missing.md) "
                     "[bad anchor](there.md#nowhere) ![img](gone.png)\n```\n[code](not-a-link.md)\n```\n")
    assert broken_links([links]) == ["links.md: missing.md (no such file)", "links.md: there.md#nowhere (no such heading)",
                                     "links.md: gone.png (no such file)"]

    scripts = {"block", "tail", "gpu_check"}
    assert misnamed_results(["block.json", "block_kernels.md", "tail.png", "gpu_check_tests.txt"], scripts) == []
    assert len(misnamed_results(["block_session22.json", "block_run1.md", "tp_ac48dd1.md", "block_2026-11-30.md",
                                 "block_v1.md", "block_final.md", "shared_strategy.md"], scripts)) == 7
