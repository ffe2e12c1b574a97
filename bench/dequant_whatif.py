"""Timing-only what-if: the routed kernels with the dequantiser's inline PTX swapped for a cheaper, wrong one.

Bounds what a cheaper expansion of MXFP4 codes could buy the register-dequant (decode) and staged (prefill)
kernels: the swap happens before the first compile (lut_dequant._PAIRS_TEXT), then bench/routed_ring.py
(decode) or bench/prefill_blocks.py (prefill, M = 4096 only) runs as usual in this process. The outputs are
wrong on purpose, so read only the times. One variant per process (Triton caches the compiled text):

    PYTHONPATH=. python3 bench/dequant_whatif.py VARIANT decode  --out DIR --rings tma --m 8 32 128 --rounds 2 --name whatif_VARIANT
    PYTHONPATH=. python3 bench/dequant_whatif.py VARIANT prefill --out DIR --name prefill_whatif_VARIANT

Variants: head (the library's text), nodequant (the word itself as the four bf16x2 operands), noscale (no bf16x2
scale multiply), half (two pairs per word, each used twice), iadd / f16mul / bf16fma (the scale multiply as
another instruction of the same count). Results: bench/results/routed_dequant_whatif.md and
prefill_dequant_whatif.md (producer_notes.md run 17).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latent_moe_fusion.ops.gluon_kernels import lut_dequant  # noqa: E402

_SAME_WORD = """
        {
        mov.b32 {$0, $4}, $8;
        mov.b32 {$1, $5}, $8;
        mov.b32 {$2, $6}, $8;
        mov.b32 {$3, $7}, $8;
        }
        """
_HALF = """
        {
        .reg .b32 t, p0, p1;
        and.b32 t, $8, 0x000F000F;
        mul.lo.u32 t, t, 4160;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 p0, t, $9;
        and.b32 t, $8, 0x00F000F0;
        mul.lo.u32 t, t, 260;
        and.b32 t, t, 0x81C081C0;
        mul.rn.bf16x2 p1, t, $9;
        mov.b32 {$0, $4}, p0;
        mov.b32 {$1, $5}, p1;
        mov.b32 {$2, $6}, p0;
        mov.b32 {$3, $7}, p1;
        }
        """
_SCALE_AS = {"noscale": "mov.b32 p{i}, t;", "iadd": "add.u32 p{i}, t, $9;", "f16mul": "mul.rn.f16x2 p{i}, t, $9;",
             "bf16fma": "fma.rn.bf16x2 p{i}, t, $9, t;"}
VARIANTS = ("head", "nodequant", "half", *_SCALE_AS)


def variant_text(name: str) -> str:
    """The inline PTX of codes_to_bf16 for a variant ($8: word, $9: bf16x2 factor; $0 .. $7: outputs)."""
    if name == "head":
        return lut_dequant.FP4_PAIRS_BF16_ASM
    if name == "nodequant":
        return _SAME_WORD
    if name == "half":
        return _HALF
    if name not in _SCALE_AS:
        raise SystemExit(f"unknown variant {name!r}: expected one of {', '.join(VARIANTS)}")
    text = lut_dequant.FP4_PAIRS_BF16_ASM
    for i in range(4):
        text = text.replace(f"mul.rn.bf16x2 p{i}, t, $9;", _SCALE_AS[name].format(i=i))
    assert "mul.rn.bf16x2" not in text
    return text


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[2] not in ("decode", "prefill"):
        raise SystemExit(__doc__)
    name, target = sys.argv[1], sys.argv[2]
    from triton.experimental.gluon import language as gl

    lut_dequant._PAIRS_TEXT = gl.constexpr(variant_text(name))
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    if target == "decode":
        from bench import routed_ring

        routed_ring.main()
    else:
        from bench import prefill_blocks

        prefill_blocks.CASES = [("ep_share", 4096), ("all_local", 4096)]
        prefill_blocks.main()


if __name__ == "__main__":
    main()
