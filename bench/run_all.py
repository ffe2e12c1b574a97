"""`make bench`: run every benchmark on the GPU and regenerate bench/results/ (JSON, Markdown, PNG)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
BENCHMARKS = ("tail.py", "producer.py", "block.py")


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("make bench needs a CUDA GPU (the figures are for an H200); nothing was run.")
        return 1
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR.parent), PYTHONUNBUFFERED="1")
    failed = []
    for name in BENCHMARKS:
        script = BENCH_DIR / name
        if not script.exists():
            continue
        print(f"== {name}", flush=True)
        if subprocess.call([sys.executable, str(script), "--out", str(BENCH_DIR / "results")], env=env):
            failed.append(name)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
