"""Which placements of an MXFP4 word's bits could the register dequantiser expand with fewer instructions?

The wgmma kernels (ops/routed/gluon/lut_dequant.py) expand two codes per 32-bit register, one per 16-bit lane:
a code's three magnitude bits go to bf16 bits 6..8 and its sign to bit 15 (the bf16x2 scale multiply then fixes
the exponent). In DESIGN.md's nibble order each code's sign sits right above its magnitude, so magnitude and sign
need different shifts: a mask, a multiply that lays out both copies, a mask (plus the scale multiply) per pair.

A load-time repack could place each pair's 8 bits anywhere in the word. The cheapest expansion of a pair is then
one mask (bits already in place) or a rotate and a mask (bits at a rotated copy of the target positions). This
script checks exhaustively how many pairs of a word can be placed that way: the 8 target bits of a pair are
P = {6, 7, 8, 15, 22, 23, 24, 31}, and the question is how many rotations of P tile the 32 bits of a word, and
what the bits left over look like (3 contiguous magnitude bits would let the last pair take 3 instructions).

    python3 bench/dequant_encodings.py --out bench/results
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

PAIR_BITS = (6, 7, 8, 15, 22, 23, 24, 31)  # magnitude (6..8) and sign (15) of both lanes


def rotated(t: int) -> frozenset[int]:
    return frozenset((b + t) % 32 for b in PAIR_BITS)


def tilings(copies: int) -> list[tuple[int, ...]]:
    """Rotations t_1 < ... < t_copies whose rotated copies of PAIR_BITS are disjoint."""
    found = []
    for ts in itertools.combinations(range(32), copies):
        sets = [rotated(t) for t in ts]
        if all(not (a & b) for a, b in itertools.combinations(sets, 2)):
            found.append(ts)
    return found


def runs(bits: set[int]) -> tuple[int, ...]:
    """Lengths of the runs of consecutive bits (cyclic within a 16-bit lane) of the lane-0 part of bits."""
    lane = {b % 16 for b in bits}
    starts = [b for b in lane if (b - 1) % 16 not in lane]
    lengths = []
    for s in starts:
        n = 0
        while (s + n) % 16 in lane:
            n += 1
        lengths.append(n)
    return tuple(sorted(lengths))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    four, three = tilings(4), tilings(3)
    leftovers: dict[tuple[int, ...], int] = {}
    for ts in three:
        left = set(range(32)) - set().union(*(rotated(t) for t in ts))
        shape = runs(left)
        leftovers[shape] = leftovers.get(shape, 0) + 1
    with_run_of_3 = sum(n for shape, n in leftovers.items() if max(shape) >= 3)
    result = {"pair_bits": PAIR_BITS, "tilings_by_4_rotations": len(four), "tilings_by_3_rotations": len(three),
              "leftover_run_shapes": {"+".join(map(str, k)): v for k, v in sorted(leftovers.items())},
              "leftovers_with_3_contiguous_bits": with_run_of_3}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dequant_encodings.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# dequant_encodings: rotated placements of a repacked MXFP4 word (exhaustive, no GPU)", "",
             f"Target bits of a pair of codes: {list(PAIR_BITS)} (magnitude at bf16 bits 6..8, sign at 15, both lanes).",
             "",
             "| question | answer |", "|---|---|",
             f"| sets of 4 rotations tiling the word | {len(four)} |",
             f"| sets of 3 disjoint rotations | {len(three)} |",
             "| lane-0 shapes of the 4 bits left (run lengths), count | "
             + ", ".join(f"{k}: {v}" for k, v in result["leftover_run_shapes"].items()) + " |",
             f"| leftovers holding 3 contiguous bits | {with_run_of_3} |", "",
             "So a repacked word expands at best 3 pairs with a rotate and a mask (one of them with a mask alone) and "
             "the fourth with ~5 instructions (its magnitude bits never lie in one run): 1 + 2 + 2 + 5 = 10 integer "
             "instructions per word plus 4 scale multiplies, against 13 + 4 for DESIGN.md's nibble order "
             "(producer_notes.md run 17).", ""]
    (out / "dequant_encodings.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
