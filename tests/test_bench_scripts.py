"""`make bench` runs what exists, and every benchmark script at least imports and parses its arguments
on a machine without a GPU (the figures themselves need the H200)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run_all import BENCH_DIR, BENCHMARKS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script", sorted({name for name, _, _ in BENCHMARKS}))
def test_benchmark_script_parses_its_arguments(script):
    assert (BENCH_DIR / script).exists(), f"bench/run_all.py lists {script}, which does not exist"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(BENCH_DIR / script), "--help"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--out" in done.stdout
