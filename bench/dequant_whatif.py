"""Timing-only what-if: the routed kernels with the dequantiser's inline PTX swapped for a cheaper, wrong one.

Bounds what a cheaper expansion of MXFP4 codes could buy the register-dequant (decode) and staged (prefill)
kernels. Each variant runs in a process of its own (Triton caches the compiled text): the swap happens before the
first compile (lut_dequant._PAIRS_TEXT), then bench/routed_ring.py (decode: the TMA rings at M = 8 / 32 / 128) or
bench/prefill_blocks.py (prefill: EP share and all local at M = 4096) runs as usual. The outputs are wrong on
purpose: read only the times. Each variant runs once, the library's own text first and last (their spread is
the run's noise).

    PYTHONPATH=. python3 bench/dequant_whatif.py --out bench/results [--targets decode prefill] [--rounds 2]
        [--variants head nodequant noscale half iadd f16mul bf16fma]

-> routed_dequant_whatif.{md,json} (decode), prefill_dequant_whatif.{md,json} (prefill). Variants: head (the
library's text), nodequant (the word itself as the four bf16x2 operands), noscale (no bf16x2 scale multiply),
half (two pairs per word, each used twice), iadd / f16mul / bf16fma (the scale multiply as another instruction of
the same count). producer_notes.md run 17 reads them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latent_moe_fusion.ops.routed.gluon import lut_dequant  # noqa: E402

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
VARIANT_NOTES = {
    "head": "the library's dequantiser (per pair of codes: mask, spreading multiply, mask, bf16x2 scale multiply)",
    "nodequant": "no expansion: the word itself as the four bf16x2 operands (ptxas adds moves for the MMA's quads)",
    "half": "two pairs expanded per word instead of four, each used twice (moves added for the MMA's quads)",
    "noscale": "the expansion without the bf16x2 scale multiply",
    "iadd": "the scale multiply as an integer add (same count, ALU pipe instead of FMA)",
    "f16mul": "the scale multiply as an fp16x2 multiply (same count)",
    "bf16fma": "the scale multiply as a bf16x2 fma (same count)",
}


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


TARGETS = {"decode": ("routed_ring", ["--rings", "tma", "--m", "8", "32", "128"]),
           "prefill": ("prefill_blocks", [])}
COLUMNS = {"decode": ["round", "variant", "M", "l1_us", "l1_x_floor", "l2_us", "l2_x_floor", "routed_us"],
           "prefill": ["round", "variant", "routing", "M", "blocks", "op_us", "l1_us", "l2_us"]}
OUT_NAMES = {"decode": "routed_dequant_whatif", "prefill": "prefill_dequant_whatif"}


def drive(name: str, target: str, bench_args: list[str]) -> None:
    """This process: swap the text, then run the target's benchmark with bench_args."""
    from triton.experimental.gluon import language as gl

    lut_dequant._PAIRS_TEXT = gl.constexpr(variant_text(name))
    module, fixed = TARGETS[target]
    sys.argv = [module, *fixed, *bench_args]
    if target == "decode":
        from bench import routed_ring

        routed_ring.main()
    else:
        from bench import prefill_blocks

        prefill_blocks.CASES = [("ep_share", 4096), ("all_local", 4096)]
        prefill_blocks.main()


def _rows(target: str, variant: str, rnd: int, path: Path) -> list[dict]:
    rows = json.loads(path.read_text())["rows"]
    if target == "prefill":
        return [{"round": rnd, "variant": variant, "routing": r["routing"], "M": r["M"], "blocks": r["variant"],
                 "op_us": r["op_us"], "l1_us": r["l1_us"], "l2_us": r["l2_us"]} for r in rows]
    return [{"round": rnd, "variant": variant, "M": r["M"], "l1_us": r["l1_us"], "l1_x_floor": r["l1_x_floor"],
             "l2_us": r["l2_us"], "l2_x_floor": r["l2_x_floor"], "routed_us": r["routed_us"]} for r in rows]


def main() -> None:
    if sys.argv[1:2] == ["--driver"]:  # this process runs one variant: the rest goes to the target's benchmark
        drive(sys.argv[2], sys.argv[3], sys.argv[4:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2, help="routed_ring's alternating rounds within a decode run")
    args = ap.parse_args()
    from bench.common import environment, write_results

    order = [v for v in args.variants if v != "head"]
    order = ["head", *order, "head"] if "head" in args.variants else order
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.targets:
            rows: list[dict] = []
            for rnd, variant in enumerate(order):
                name = f"{target}_{rnd}_{variant}"
                bench_args = ["--out", tmp, "--name", name] + (["--rounds", str(args.rounds)] if target == "decode" else [])
                cmd = [sys.executable, __file__, "--driver", variant, target, *bench_args]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    raise SystemExit(f"{variant} ({target}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
                rows += _rows(target, variant, rnd, Path(tmp) / f"{name}.json")
                print(rows[-1], flush=True)
            meta = environment() | {
                "config": "Kimi K3 rank's routed MXFP4 experts (112/896 local, top-16, L=3584, I=3072); decode: "
                          "routed_ring.py's one-token-per-row cases on the TMA rings; prefill: prefill_blocks.py",
                "variants": {v: VARIANT_NOTES[v] for v in args.variants}}
            write_results(OUT_NAMES[target], rows, COLUMNS[target], meta, args.out,
                          notes="Timing only, wrong outputs. round: the process's place in the alternating order "
                                "(the library's own text first and last). Floors (decode): MXFP4 codes + scales of "
                                "the experts hit over the measured copy bandwidth.")


if __name__ == "__main__":
    main()
