"""A tiny interpreter for the integer PTX the MXFP4 dequantisers use, so the very asm text the GPU
compiles is checked on the CPU (the Triton interpreter cannot run inline asm).

Covers: mov.b32 (also the unpack form `mov.b32 {lo, hi}, r` and the pack form `mov.b32 r, {lo, hi}`), and.b32,
or.b32, shl.b32, shr.b32 (logical), lop3.b32, mul.lo.u32, prmt.b32 (default mode), mul.rn.bf16x2, mul.rn.f16x2 and
cvt.rn.satfinite.e4m3x2.f16x2. Operands: named registers, $N arguments, decimal or hex immediates.
"""

from __future__ import annotations

import re

import numpy as np

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, c: int) -> int:
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """Bit i of the result: bit (a_i << 2 | b_i << 1 | c_i) of lut (PTX: lut = F(0xF0, 0xCC, 0xAA))."""
    return sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i for i in range(32))


def _bf16_bits_to_f32(h: int) -> np.float32:
    return np.array([h << 16], dtype=np.uint32).view(np.float32)[0]


def _f32_to_bf16_bits(x: np.float32) -> int:
    bits = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _mul_bf16x2(a: int, b: int) -> int:
    out = 0
    for half in (0, 16):
        x = _bf16_bits_to_f32((a >> half) & 0xFFFF)
        y = _bf16_bits_to_f32((b >> half) & 0xFFFF)
        with np.errstate(over="ignore", under="ignore"):
            out |= _f32_to_bf16_bits(np.float32(x * y)) << half  # exact product, then one rounding
    return out


def _mul_f16x2(a: int, b: int) -> int:
    out = 0
    for half in (0, 16):
        x = np.array([(a >> half) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
        y = np.array([(b >> half) & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
        with np.errstate(over="ignore", under="ignore"):
            prod = np.float16(np.float64(x) * np.float64(y))  # exact product, one rounding to nearest even
        out |= int(np.array([prod], dtype=np.float16).view(np.uint16)[0]) << half
    return out


def _cvt_e4m3x2_f16x2(a: int) -> int:
    """Each f16 half to e4m3 (nearest even, finite values saturate to +-448), the upper half to the upper byte."""
    import torch

    out = 0
    for half, shift in ((0, 0), (16, 8)):
        x = float(np.array([(a >> half) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])
        if not np.isnan(x):
            x = max(-448.0, min(448.0, x))
        out |= int(torch.tensor([x]).to(torch.float8_e4m3fn).view(torch.uint8)[0]) << shift
    return out


_OPS = {
    "mov.b32": lambda x: x[0],
    "and.b32": lambda x: x[0] & x[1],
    "or.b32": lambda x: x[0] | x[1],
    "shl.b32": lambda x: (x[0] << x[1]) & MASK,
    "shr.b32": lambda x: x[0] >> x[1],
    "lop3.b32": lambda x: _lop3(*x),
    "mul.lo.u32": lambda x: x[0] * x[1],
    "prmt.b32": lambda x: _prmt(*x),
    "mul.rn.bf16x2": lambda x: _mul_bf16x2(*x),
    "mul.rn.f16x2": lambda x: _mul_f16x2(*x),
    "cvt.rn.satfinite.e4m3x2.f16x2": lambda x: _cvt_e4m3x2_f16x2(*x),
}


def run_ptx(asm: str, inputs: dict[int, int], num_outputs: int) -> list[int]:
    """Run `asm` with $k = inputs[k]; returns [$0, ..., $(num_outputs - 1)]."""
    regs: dict[str, int] = {f"${k}": v & MASK for k, v in inputs.items()}

    def value(tok: str) -> int:
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", tok):
            return int(tok, 0) & MASK
        raise KeyError(f"read of unset register {tok!r}")

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32" and rest.startswith("{"):  # unpack into 16-bit halves: {lo, hi}, src
            halves, src = rest[1:].split("}", 1)
            lo, hi = (t.strip() for t in halves.split(","))
            v = value(src.strip(" ,"))
            regs[lo], regs[hi] = v & 0xFFFF, v >> 16
            continue
        if op == "mov.b32" and "{" in rest:  # pack 16-bit halves: dest, {lo, hi}
            dest, halves = rest.split(",", 1)
            lo, hi = (value(t.strip()) for t in halves.strip().strip("{}").split(","))
            regs[dest.strip()] = (lo & 0xFFFF) | (hi & 0xFFFF) << 16
            continue
        dest, *args = [t.strip() for t in rest.split(",")]
        if op not in _OPS:
            raise NotImplementedError(f"ptx_emulator: {op}")
        regs[dest] = _OPS[op]([value(t) for t in args]) & MASK
    return [regs[f"${k}"] for k in range(num_outputs)]
