"""Does a fresh install of the package next to each supported torch keep the Triton that torch pins?

For every row of the support matrix, pip resolves `torch==X` together with this checkout (a dry run: nothing is
installed) and the Triton it picks must be the one that torch's CUDA wheel pins. pip runs isolated from this
machine's pip configuration, so it sees the registry's CUDA wheels rather than a local CPU build (which declares no
Triton). Exit code 1 on any mismatch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# torch release -> the Triton its CUDA wheel pins (README's support matrix)
MATRIX = {"2.11.0": "3.6.0", "2.12.1": "3.7.1", "2.13.0": "3.7.1", "2.14.1": "3.8.0"}


def resolved(torch_version: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                        "--quiet", "--report", str(report), f"torch=={torch_version}", str(ROOT)],
                       check=True, timeout=900)
        items = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in items}


def main() -> int:
    failed = 0
    for torch_version, triton_version in MATRIX.items():
        got = resolved(torch_version)
        ok = got.get("torch", "").split("+")[0] == torch_version and got.get("triton") == triton_version
        failed += not ok
        print(f"torch {torch_version}: resolves torch {got.get('torch')}, triton {got.get('triton')} "
              f"(its pin: {triton_version}) {'ok' if ok else 'MISMATCH'}", flush=True)
    verdict = "every supported torch keeps its Triton" if not failed else f"{failed} torch version(s) do not"
    print(f"install matrix: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
