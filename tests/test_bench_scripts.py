"""`make bench` runs what exists, and every benchmark script at least imports and parses its arguments
on a machine without a GPU (the figures themselves need the H200)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run_all import BENCH_DIR, BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted({name for name, _, _ in BENCHMARKS})


@pytest.fixture(scope="module")
def help_runs():
    """`script --help` for every script, started together: each spends seconds importing torch, and
    CI's cores would otherwise take them one after another."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    running = {
        name: subprocess.Popen([sys.executable, str(BENCH_DIR / name), "--help"], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in SCRIPTS if (BENCH_DIR / name).exists()
    }
    done = {}
    for name, proc in running.items():
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = (proc.returncode, out, err)
    return done


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_script_parses_its_arguments(script, help_runs):
    assert (BENCH_DIR / script).exists(), f"bench/run_all.py lists {script}, which does not exist"
    returncode, out, err = help_runs[script]
    assert returncode == 0, err[-2000:]
    assert "--out" in out
