"""Reading sm_90 machine code compiled on a machine without a GPU (Triton's bundled cuobjdump): the SASS text, the
registers a kernel takes, and its loops. The sm_90 compile tests' helper scripts count what their kernels promise
(no spills, the operands' path, instructions per k step) with these."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

SM90 = GPUTarget("cuda", 90, 32)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(cubin: bytes) -> str:
    return _cuobjdump(cubin, "--dump-sass")


def registers(cubin: bytes) -> int:
    return int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "--dump-resource-usage")).group(1))


def spills(sass: str) -> int:
    """Local-memory loads and stores anywhere in the kernel."""
    return len(re.findall(r"\b(?:LDL|STL)\b", sass))


def loop_ranges(sass: str) -> list[list[str]]:
    """Opcodes of every backward-branch range of the SASS (from the branch target to the branch): the
    loops, inner ones inside outer ones."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    addr = [(int(a, 16), op, rest) for a, op, rest in lines]
    ranges = []
    for i, (a, op, rest) in enumerate(addr):
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < a:
            start = next(j for j, x in enumerate(addr) if x[0] >= int(m.group(1), 16))
            ranges.append([op for _, op, _ in addr[start:i + 1]])
    return ranges


def main_loop(sass: str) -> list[str]:
    """Opcodes of the K loop of a dequantising kernel: the longest backward-branch range that multiplies bf16
    pairs (the dequantiser's scale) and evaluates no transcendental (MUFU: the SiTU after the loop; ranges of
    peeled iterations can span both). Without such a range (a kernel that converts in FP32): the longest one."""
    ranges = loop_ranges(sass)
    dequant = [r for r in ranges if any(o.startswith("HMUL2") for o in r) and not any(o.startswith("MUFU") for o in r)]
    return max(dequant or ranges, key=len, default=[])
