"""The layout of latent_moe_fusion/ops: one folder per op family, helpers of several families in ops/common.

- Every module file name (`__init__.py` aside) occurs once in the package, so that a name says which file it is.
- No op family imports another (a family: a direct subfolder of ops/ other than common/), and common/ imports no
  family: what two families share lives in common/.
- Inside a family a subfolder (a kernel language or an optional library: triton/, gluon/, cute/, deepgemm/, ...)
  imports no sibling subfolder: what two of them share sits in the family's own folder or in common/.
- Every data file (*.json) under the package is declared as package data in pyproject.toml, so that an installed copy
  has it.

Imports are read with `ast`, lazy ones inside functions included; relative imports are resolved against the module.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "latent_moe_fusion"
PYPROJECT = PACKAGE.parent / "pyproject.toml"
OPS = ("latent_moe_fusion", "ops")
COMMON = "common"


def _module_name(path: Path, root: Path) -> tuple[str, ...]:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(path: Path, root: Path = PACKAGE) -> list[tuple[int, tuple[str, ...]]]:
    """(line, absolute dotted module as a tuple) of every import in the file; `from X import name` yields X.name
    too, since the name may be a submodule."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, tuple(alias.name.split("."))) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            target = base + tuple(node.module.split(".") if node.module else ())
            found.append((node.lineno, target))
            found += [(node.lineno, target + (alias.name,)) for alias in node.names]
    return found


def family_of(module: tuple[str, ...], root: Path = PACKAGE) -> str | None:
    """The op family folder (or "common") of a module or package under ops/; None for anything else (outside ops/,
    ops/__init__.py, a module directly in ops/)."""
    if len(module) < 3 or module[:2] != OPS or not (root / "ops" / module[2]).is_dir():
        return None
    return module[2]


def subfolder_of(module: tuple[str, ...], root: Path = PACKAGE) -> str | None:
    """The subfolder of its family that a module or package sits in; None for the family's own modules."""
    if len(module) < 4 or not (root / "ops" / module[2] / module[3]).is_dir():
        return None
    return module[3]


def layout_violations(root: Path = PACKAGE) -> list[str]:
    """Every import that crosses op families, leaves common/ for a family, or joins sibling subfolders (one line per
    import statement)."""
    bad = {}
    for path in sorted((root / "ops").rglob("*.py")):
        module = _module_name(path, root)
        here = family_of(module, root)
        if here is None:
            continue
        where = path.relative_to(root.parent)
        for line, target in imported_modules(path, root):
            there = family_of(target, root)
            if there is None:
                continue
            if there != here:
                if here == COMMON or there != COMMON:
                    bad.setdefault((str(where), line), f"{where}:{line}: {here}/ imports {there}/ ({'.'.join(target)})")
                continue
            mine, theirs = subfolder_of(module, root), subfolder_of(target, root)
            if here != COMMON and mine is not None and theirs is not None and mine != theirs:
                bad.setdefault((str(where), line), f"{where}:{line}: subfolder {mine}/ imports sibling subfolder "
                                                   f"{theirs}/ ({'.'.join(target)}) of family {here}/")
    return [bad[key] for key in sorted(bad)]


def duplicate_file_names(root: Path = PACKAGE) -> dict[str, list[str]]:
    paths = [p for p in root.rglob("*.py") if p.name != "__init__.py"]
    counts = Counter(p.name for p in paths)
    return {name: sorted(str(p.relative_to(root.parent)) for p in paths if p.name == name)
            for name, n in counts.items() if n > 1}


def test_every_module_file_name_is_unique():
    duplicates = duplicate_file_names()
    assert not duplicates, f"module file names used more than once: {duplicates}"


def test_op_families_import_only_themselves_and_common():
    bad = layout_violations()
    assert not bad, "imports across op families (move what both use to ops/common/):\n" + "\n".join(bad)


def test_ops_holds_only_family_folders():
    ops = PACKAGE / "ops"
    loose = sorted(p.name for p in ops.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules directly in ops/ belong in an op family folder or in common/: {loose}"
    families = sorted(p.name for p in ops.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert COMMON in families and len(families) > 1, families


def _write(root: Path, relative: str, text: str = "") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture()
def toy_package(tmp_path: Path) -> Path:
    """A small latent_moe_fusion/ops tree that obeys the rules; the tests below break it one rule at a time."""
    root = tmp_path / "latent_moe_fusion"
    for folder in ("", "ops", "ops/common", "ops/tail", "ops/tail/triton", "ops/tail/cute", "ops/routed"):
        _write(root, f"{folder}/__init__.py".lstrip("/"))
    _write(root, "ops/common/helpers.py", "import torch\n")
    _write(root, "ops/tail/tail_op.py", "from ..common.helpers import torch\nfrom .triton import tail_kernel\n")
    _write(root, "ops/tail/triton/tail_kernel.py", "from ...common import helpers\nfrom ..tail_op import torch\n")
    _write(root, "ops/tail/cute/cute_kernel.py", "from .. import tail_op\n")
    _write(root, "ops/routed/routed_op.py", "from latent_moe_fusion.ops.common.helpers import torch\n")
    return root


def test_the_checks_pass_on_a_layout_that_obeys_them(toy_package):
    assert layout_violations(toy_package) == []
    assert duplicate_file_names(toy_package) == {}


@pytest.mark.parametrize("relative, text, expected", [
    ("ops/routed/uses_tail.py", "from ..tail.tail_op import torch\n", "routed/ imports tail/"),
    ("ops/routed/lazy.py", "def f():\n    from latent_moe_fusion.ops.tail import tail_op\n", "routed/ imports tail/"),
    ("ops/routed/whole.py", "import latent_moe_fusion.ops.tail.triton.tail_kernel\n", "routed/ imports tail/"),
    ("ops/routed/by_name.py", "from .. import tail\n", "routed/ imports tail/"),
    ("ops/common/up.py", "from ..routed import routed_op\n", "common/ imports routed/"),
    ("ops/tail/cute/sibling.py", "from ..triton.tail_kernel import torch\n",
     "subfolder cute/ imports sibling subfolder triton/"),
])
def test_the_import_check_fails_on_a_violation(toy_package, relative, text, expected):
    _write(toy_package, relative, text)
    bad = layout_violations(toy_package)
    assert len(bad) == 1 and expected in bad[0], bad


def test_the_name_check_fails_on_a_duplicate(toy_package):
    _write(toy_package, "ops/routed/triton/__init__.py")
    _write(toy_package, "ops/routed/triton/tail_kernel.py")
    assert duplicate_file_names(toy_package) == {"tail_kernel.py": [
        "latent_moe_fusion/ops/routed/triton/tail_kernel.py", "latent_moe_fusion/ops/tail/triton/tail_kernel.py"]}


def undeclared_package_data(root: Path = PACKAGE, pyproject: Path = PYPROJECT) -> list[str]:
    """Every data file (*.json) under the package that pyproject.toml's [tool.setuptools.package-data] does not
    name: `pip install` would leave it out, and the code that reads it would fail in an installed copy."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-data", {})
    missing = []
    for path in sorted(root.rglob("*.json")):
        package = ".".join(path.parent.relative_to(root.parent).parts)
        if not any(path.match(str(path.parent / pattern)) for pattern in declared.get(package, ())):
            missing.append(f"{path.relative_to(root.parent)} (add it to [tool.setuptools.package-data] {package!r})")
    return missing


def test_every_data_file_is_package_data():
    missing = undeclared_package_data()
    assert not missing, "data files that `pip install` would leave out:\n" + "\n".join(missing)


def test_the_package_data_check_fails_on_an_undeclared_file(toy_package):
    pyproject = toy_package.parent / "pyproject.toml"
    pyproject.write_text('[tool.setuptools.package-data]\n"latent_moe_fusion.ops.routed" = ["declared.json"]\n')
    _write(toy_package, "ops/routed/declared.json", "{}")
    assert undeclared_package_data(toy_package, pyproject) == []
    _write(toy_package, "ops/tail/cute/table.json", "{}")
    assert undeclared_package_data(toy_package, pyproject) == [
        "latent_moe_fusion/ops/tail/cute/table.json (add it to [tool.setuptools.package-data] "
        "'latent_moe_fusion.ops.tail.cute')"]
