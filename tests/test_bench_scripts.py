"""`make bench` runs what exists, and every benchmark script at least imports and parses its arguments
on a machine without a GPU (the figures themselves need the H200)."""

import contextlib
import io
import os
import runpy
import sys
import traceback
from pathlib import Path
from unittest import mock

import pytest

from bench.run_all import BENCH_DIR, BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted({name for name, _, _ in BENCHMARKS})


def _help(script: Path) -> tuple[int, str, str]:
    """`script --help` run as __main__ in this process: (exit code, stdout, stderr). One process for all
    scripts: each would otherwise spend seconds importing torch, triton and the library (CI: ~170 s)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with mock.patch.object(sys, "argv", [str(script), "--help"]), mock.patch.dict(os.environ, {}), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exc:  # argparse exits after printing the help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:  # noqa: BLE001 - reported by the test
            code = 1
            err.write(traceback.format_exc())
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def help_runs():
    saved_path = list(sys.path)
    try:
        return {name: _help(BENCH_DIR / name) for name in SCRIPTS if (BENCH_DIR / name).exists()}
    finally:
        sys.path[:] = saved_path  # the scripts put the repository first


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_parses_its_arguments(script, help_runs):
    assert (BENCH_DIR / script).exists(), f"bench/run_all.py lists {script}, which does not exist"
    returncode, out, err = help_runs[script]
    assert returncode == 0, err[-2000:]
    assert "--out" in out


def test_a_script_that_cannot_import_or_parse_is_reported(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_for_lmf\n")
    code, _, err = _help(broken)
    assert code == 1 and "no_such_module_for_lmf" in err
    no_out = tmp_path / "no_out.py"
    no_out.write_text("import argparse\nargparse.ArgumentParser().parse_args()\n")
    code, out, _ = _help(no_out)
    assert code == 0 and "--out" not in out  # the test above would then fail on the missing --out


def test_every_benchmark_script_is_in_make_bench():
    """A script with a main that run_all.py does not list would never regenerate its results."""
    helpers = {"run_all.py"}
    scripts = {p.name for p in BENCH_DIR.glob("*.py") if "__main__" in p.read_text()} - helpers
    missing = sorted(scripts - set(SCRIPTS))
    assert not missing, f"bench/run_all.py BENCHMARKS does not list {missing}"
