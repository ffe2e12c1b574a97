"""latent_moe_fusion/envs.py: the one registry of environment variables. Package code reads the environment only
through it, names only variables it declares, and every declaration is read where it says; its parsers accept
their values, treat empty as unset and refuse anything else naming the variable and what it takes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from latent_moe_fusion import envs, tuning

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "latent_moe_fusion"
REGISTRY = PACKAGE / "envs.py"
NAME = re.compile(r"LMF_[A-Z0-9_]*[A-Z0-9]")
READERS = ("read", "is_set", "raw")  # envs' functions that read a variable


def _package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p != REGISTRY)


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _bindings(tree: ast.Module) -> dict[str, ast.expr]:
    """NAME = value bindings anywhere in the module (module constants, locals such as per_op = f"..."), last wins."""
    bound: dict[str, ast.expr] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            bound[node.targets[0].id] = node.value
    return bound


def _loop_bindings(call: ast.AST, parents: dict) -> dict[str, ast.expr]:
    """The comprehension variables in scope at `call`: name -> what it iterates."""
    loops: dict[str, ast.expr] = {}
    node = parents.get(call)
    while node is not None:
        if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
            for gen in node.generators:
                if isinstance(gen.target, ast.Name):
                    loops.setdefault(gen.target.id, gen.iter)
        node = parents.get(node)
    return loops


def _names_of(node: ast.expr, bound: dict, loops: dict) -> set[str] | None:
    """The variable names an argument can hold: a literal, a bound name (or a tuple of them iterated by a
    comprehension), or an f-string a family's prefix starts; None where it cannot be told."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = node.values[0].value
        return {f.name for f in envs._FAMILIES if f.prefix == prefix} or None
    if isinstance(node, (ast.Tuple, ast.List)):
        parts = [_names_of(e, bound, {}) for e in node.elts]
        return None if any(p is None for p in parts) else set().union(*parts)
    if isinstance(node, ast.Name):
        if node.id in loops:
            return _names_of(loops[node.id], bound, {})
        if node.id in bound:
            return _names_of(bound[node.id], bound, {})
    return None


def _env_reads() -> tuple[dict[str, set[str]], list[str]]:
    """({declared name: files that read it through envs}, reads whose variable cannot be told)."""
    reads: dict[str, set[str]] = {}
    unknown = []
    for path in _package_files():
        tree = ast.parse(path.read_text())
        bound = _bindings(tree)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in READERS
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "envs"):
                continue
            names = _names_of(call.args[0], bound, _loop_bindings(call, parents)) if call.args else None
            if names is None:
                unknown.append(f"{_relative(path)}:{call.lineno}")
                continue
            for name in names:
                reads.setdefault(envs.entry(name).name, set()).add(_relative(path))
    return reads, unknown


def test_no_package_file_reads_the_environment_but_the_registry():
    offenders = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            direct = isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os"
            imported = isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv") for a in node.names)
            if direct or imported:
                offenders.append(f"{_relative(path)}:{node.lineno}")
    assert not offenders, f"read the environment through latent_moe_fusion.envs.read, not os.environ: {offenders}"


def test_every_lmf_name_the_package_mentions_is_declared():
    declared = set(envs.VARIABLES) | {m for f in envs._FAMILIES for m in f.members}
    undeclared, retired = {}, {}
    for path in _package_files():
        for name in set(NAME.findall(path.read_text())):
            if name in envs.RETIRED:
                retired.setdefault(name, []).append(_relative(path))
            elif name not in declared:
                undeclared.setdefault(name, []).append(_relative(path))
    assert not undeclared, f"declare these in latent_moe_fusion/envs.py (or stop naming them): {undeclared}"
    assert not retired, f"retired variables are tuning overrides now; name the override field instead: {retired}"
    assert not set(envs.RETIRED) & declared


def test_every_declared_variable_is_read_where_the_registry_says():
    reads, unknown = _env_reads()
    assert not unknown, f"name the variable as a literal or a module constant at these envs reads: {unknown}"
    for name, var in envs.VARIABLES.items():
        assert name in reads, f"{name} is declared but nothing reads it: remove it from latent_moe_fusion/envs.py"
        assert reads[name] == set(var.read_in), (f"{name} is read in {sorted(reads[name])}, but its EnvVar.read_in "
                                                 f"says {sorted(var.read_in)}: update read_in")


def test_every_override_is_read_where_its_knob_says_and_has_a_parser():
    reads: dict[str, set[str]] = {}
    for path in _package_files():
        tree = ast.parse(path.read_text())
        holders = set()  # names bound to tuning.current()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _is_current(node.value):
                holders |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (_is_current(node.value) or (
                    isinstance(node.value, ast.Name) and node.value.id in holders)) and node.attr in tuning.NAMES:
                reads.setdefault(node.attr, set()).add(_relative(path))
    for name, knob in tuning.knobs().items():
        assert reads.get(name) == {knob.read_in}, (f"the tuning override {name} is read in {sorted(reads.get(name, []))}"
                                                   f" but its knob says {knob.read_in}: update tuning.py")
    assert set(tuning._PARSERS) == set(tuning.NAMES), "every override's reading module registers its parser"


def _is_current(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "current" and \
        isinstance(node.func.value, ast.Name) and node.func.value.id == "tuning"


def test_backend_family_names_the_ops_and_their_backends():
    from latent_moe_fusion.ops.common.backends import _REGISTRY

    ops = {op for op in _REGISTRY if hasattr(torch.ops.lmf, op)}
    assert ops == set(envs.BACKEND_OPS)
    family = envs.VARIABLES["LMF_BACKEND_<OP>"]
    for op in ops:
        for backend in _REGISTRY[op]:
            assert f"`{backend.name}`" in family.values and f"`{backend.name}`" in envs.VARIABLES["LMF_BACKEND"].values


def test_defaults_agree_with_the_reading_modules():
    from latent_moe_fusion.ops.common import symm_exchange
    from latent_moe_fusion.ops.routed import producer_config
    from latent_moe_fusion.ops.routed.router_fused import down_projection

    assert envs.VARIABLES[symm_exchange.ENV].default == "auto"
    assert envs.VARIABLES[symm_exchange.METHOD_ENV].default == symm_exchange.DEFAULT_METHOD
    for name, words in ((symm_exchange.ENV, symm_exchange.CHOICES), (symm_exchange.METHOD_ENV, symm_exchange.METHODS)):
        with pytest.raises(ValueError, match=re.escape(str(tuple(words)))):
            envs.VARIABLES[name].parse(name, "nonsense")
    assert envs.VARIABLES[down_projection.DOWN_PROJECTION_ENV].default == down_projection.DEFAULT_BACKEND
    assert set(envs.ROUTED_FP8_WORDS) == set(producer_config.ROUTED_FP8_CHOICES)


def test_read_treats_empty_as_unset_and_refuses_undeclared_names(monkeypatch):
    monkeypatch.delenv("LMF_CHECK_IDS", raising=False)
    assert envs.read("LMF_CHECK_IDS") is True and not envs.is_set("LMF_CHECK_IDS") and envs.raw("LMF_CHECK_IDS") == ""
    monkeypatch.setenv("LMF_CHECK_IDS", "")
    assert envs.read("LMF_CHECK_IDS") is True and not envs.is_set("LMF_CHECK_IDS")
    monkeypatch.setenv("LMF_CHECK_IDS", "0")
    assert envs.read("LMF_CHECK_IDS") is False and envs.is_set("LMF_CHECK_IDS")
    with pytest.raises(KeyError, match="LMF_NOT_A_SWITCH is not declared"):
        envs.read("LMF_NOT_A_SWITCH")
    monkeypatch.setenv("LMF_BACKEND_ANY_OP", "reference")  # a family takes any op's name
    assert envs.read("LMF_BACKEND_ANY_OP") == "reference"


def test_parsers_name_the_variable_and_what_it_accepts():
    assert envs.choice(("a", "b"))("LMF_T", "b") == "b"
    with pytest.raises(ValueError, match=r"LMF_T='c': expected one of a, b \(which one\) or unset"):
        envs.choice(("a", "b"), "which one")("LMF_T", "c")
    assert envs.switch("run it", "skip it")("LMF_T", "1") is True
    with pytest.raises(ValueError, match=r"LMF_T='yes': expected 1 \(run it\), 0 \(skip it\) or unset"):
        envs.switch("run it", "skip it")("LMF_T", "yes")
    fold = envs.folded_choice(("auto", "on", "off"), "auto")
    assert fold("LMF_T", " ON ") == "on" and fold("LMF_T", "  ") == "auto"
    assert [envs.lenient_flag("LMF_T", v) for v in ("0", " False ", "no", "OFF", "1", "yes", "anything")] == \
        [False, False, False, False, True, True, True]
    assert [envs.triton_flag("T", v) for v in ("1", "true", "ON", "0", "yes")] == [True, True, True, False, False]


def test_down_projection_takes_numerics_choices_and_points_labels_at_the_override(monkeypatch):
    monkeypatch.setenv("LMF_DOWN_PROJECTION", "cublas")
    assert envs.read("LMF_DOWN_PROJECTION") == "cublas"
    monkeypatch.setenv("LMF_DOWN_PROJECTION", "swap_tma:16x32x256/w4/st6/s1")
    with pytest.raises(ValueError, match=r"expected cublas or triton, or unset; a swap-kernel label is a tuning "
                                         r"override: .*overrides\(down_projection_kernel='swap_tma"):
        envs.read("LMF_DOWN_PROJECTION")


@pytest.mark.parametrize("name, read", [
    ("LMF_CHECK_IDS", "latent_moe_fusion.ops.routed.expert_ids_check:device_id_check_enabled"),
    ("LMF_DEEPGEMM_FP8_ACTIVATIONS", None),
])
def test_on_off_switches_refuse_other_words(monkeypatch, name, read):
    """Only 0 switched these off before, so a typo (`off`, `false`) silently left them on."""
    import importlib

    if read is None:
        def enabled():
            return envs.read(name)
        default = False
    else:
        module, attr = read.split(":")
        enabled = getattr(importlib.import_module(module), attr)
        default = True
    for value, want in (("1", True), ("0", False), ("", default)):
        monkeypatch.setenv(name, value)
        assert enabled() is want
    monkeypatch.delenv(name)
    assert enabled() is default
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=rf"{name}='off': expected 1 \(.*\), 0 \(.*\) or unset"):
        enabled()


def test_a_retired_variable_warns_once_and_names_its_override(monkeypatch):
    name, field = next(iter(envs.RETIRED.items()))
    monkeypatch.setenv(name, "1")
    monkeypatch.setattr(envs, "_retired_checked", False)
    with pytest.warns(UserWarning, match=rf"{name} is set but latent_moe_fusion no longer reads it: .*"
                                         rf"overrides\({field}=\.\.\.\)"):
        envs.read("LMF_CHECK_IDS")
    assert (name, field) in envs.retired_in_environment()
    assert set(envs.RETIRED.values()) <= set(tuning.NAMES)


def test_no_test_or_benchmark_sets_a_retired_variable():
    files = [*(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "bench").glob("*.sh"),
             ROOT / "Makefile"]
    found = {str(p.relative_to(ROOT)): sorted(set(NAME.findall(p.read_text())) & set(envs.RETIRED)) for p in files}
    assert not {k: v for k, v in found.items() if v}, "use latent_moe_fusion.tuning.overrides for tuning knobs"


def test_the_switches_command_prints_the_operator_variables(monkeypatch, capsys):
    from latent_moe_fusion.__main__ import main

    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "reference")
    monkeypatch.setenv("LMF_CHECK_IDS", "off")
    with tuning.overrides(group_first=True):
        assert main(["switches"]) == 0
    out = capsys.readouterr().out
    assert "LMF_BACKEND_LATENT_TAIL = 'reference' -> 'reference'" in out
    assert "LMF_CHECK_IDS = 'off' -> invalid: LMF_CHECK_IDS='off'" in out
    assert "Tuning overrides active here: group_first=True" in out
    assert all(name in out for name, var in envs.VARIABLES.items() if var.audience == envs.OPERATOR and not var.prefix)
