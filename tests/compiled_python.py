"""Python in a fresh interpreter without TRITON_INTERPRET (which the test session sets on a machine without
CUDA): there @triton.jit and @gluon.jit functions compile for real, so the sm_90 compile tests (Triton's
bundled ptxas, no GPU) run their scripts through this."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_compiled(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """`python args...` from the repository root with the repository importable; output captured as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the repository first; anything already on PYTHONPATH stays (the CI's compile matrix puts a Triton there)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
