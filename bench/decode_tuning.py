"""Decode knobs of the fused block, swept where they act: the whole compiled + fused block in CUDA graphs.

The knobs are the library's tuning overrides (latent_moe_fusion.tuning fields, read when the ops run, so one
compile serves every setting; each setting gets its own graph capture) and the operator's numerics variables
(LMF_DOWN_PROJECTION, LMF_ROUTED_FP8): programmatic dependent launch sites and
the tail's L2 prefetch depth (ops/common/pdl.py), the shapes of the side-stream shared expert's Triton programs
(K slices and rows per program of gate/up, rows and K tile per program of down), whether the routed
grouping goes before or after the shared expert's fork, the router beside the down-projection or in
a row with it, which of the two is launched first, whether lmf::route_and_produce starts the shared
expert first, in which order and which of its branches go on high-priority streams. Phase 1 times each value of each knob against the defaults in alternating rounds;
phase 2 times the defaults against every knob at its phase-1 winner.
Outputs of every setting are checked against the defaults' (relative L2; PDL, prefetch and program
shapes must not change them beyond the last-place effects of a different K split).

    PYTHONPATH=. python3 bench/decode_tuning.py --m 1 --out bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compiled_rank_block, decode_inputs  # noqa: E402
from bench.common import environment, knobs_applied, rel_l2, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import ROUTED_FP8_ENV  # noqa: E402
from latent_moe_fusion.ops.routed.router_fused.down_projection import DOWN_PROJECTION_ENV, TRITON_TABLE  # noqa: E402
from latent_moe_fusion.ops.routed.router_fused.route_and_produce import (  # noqa: E402
    SHARED_FIRST_MAX_TOKENS,
    SHARED_FIRST_URGENT_CHOICES,
)
from latent_moe_fusion.ops.routed.router_fused.route_and_project import OVERLAP_MAX_TOKENS  # noqa: E402

# Knob -> values swept: latent_moe_fusion.tuning override fields, and the operator's numerics variables (LMF_*).
KNOBS: dict[str, tuple[str, ...]] = {
    "pdl_sites": ("none", "tail"),
    "tail_prefetch": ("0", "4"),
    "group_first": ("0", "1"),
    "producer_shared_split": ("1", "2", "8"),
    "producer_decode_shared_tiles": ("32x64", "16x128"),
    "producer_shared_l2_rows": ("32", "128"),
    "producer_shared_l2_k": ("32", "128"),
    "tail_gemv": ("off", "2x512x1024w1", "4x512x1024w2"),
    "regs_split": ("2,2", "4,1", "7,2", "4,3"),
    "regs_shared": ("cublas_side", "side"),
    "routed_gemv": ("0", "1", "2x2x64w1p2", "2x4x64w1p2"),
    "router_overlap_streams": ("0", "1"),
    "router_overlap_order": ("router", "down"),
    "mxfp4_ring": ("loads", "tma,cp4", "tma"),
    "mxfp4_load_order": ("early", "late"),
    "shared_first_schedule": ("0", "1"),
    "shared_first_order": ("shared,router,down", "router,down,shared", "down,router,shared", "router,shared,down"),
    "shared_first_urgent": SHARED_FIRST_URGENT_CHOICES,
    DOWN_PROJECTION_ENV: ("cublas", "triton"),
    "down_projection_kernel": ("swap_tma:16x32x256/w4/st6/s1",),
    ROUTED_FP8_ENV: ("0", "l1,l2"),  # the FP8 routed kernels: bf16 (0) and both layers against the default (L1)
}
# Knobs that act only up to this many tokens (the side-stream Triton shared expert, the grouping order).
ACTIVE_UP_TO = {"producer_shared_split": 4, "producer_decode_shared_tiles": 1, "producer_shared_l2_rows": 4,
                "producer_shared_l2_k": 4, "group_first": 16, "tail_gemv": 2, "regs_shared": 16, "routed_gemv": 8,
                "router_overlap_streams": OVERLAP_MAX_TOKENS, "router_overlap_order": OVERLAP_MAX_TOKENS,
                "shared_first_schedule": SHARED_FIRST_MAX_TOKENS, "shared_first_order": SHARED_FIRST_MAX_TOKENS,
                "shared_first_urgent": SHARED_FIRST_MAX_TOKENS, DOWN_PROJECTION_ENV: TRITON_TABLE[-1][0],
                "down_projection_kernel": TRITON_TABLE[-1][0]}


def _time(fn, xs, knobs: dict[str, str]) -> float:
    with knobs_applied(knobs):
        return time_graph_ms(lambda i: fn(xs[i]), len(xs)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--knobs", nargs="*", choices=sorted(KNOBS), help="sweep only these (default: all)")
    ap.add_argument("--name", default="decode_tuning", help="results file name (bench/results/<name>.md)")
    ap.add_argument("--values", nargs="*", default=[], metavar="KNOB=V1,V2",
                    help="sweep these values of a knob instead of its built-in list")
    ap.add_argument("--combo", nargs="*", default=[], metavar="KNOB=V;KNOB=V",
                    help="also time these settings of several knobs at once (phase 1, no winner selection)")
    args = ap.parse_args()
    combos = {}
    for spec in args.combo:
        pairs = [item.partition("=") for item in spec.split(";")]
        if not spec or any(k not in KNOBS or not v for k, _, v in pairs):
            raise SystemExit(f"--combo {spec!r}: expected KNOB=V;KNOB=V with each KNOB one of {', '.join(sorted(KNOBS))}")
        combos[spec.replace(";", " + ")] = {k: v for k, _, v in pairs}
    for spec in args.values:
        knob, _, vals = spec.partition("=")
        if knob not in KNOBS or not vals:
            raise SystemExit(f"--values {spec!r}: expected KNOB=V1,V2 with KNOB one of {', '.join(sorted(KNOBS))}")
        KNOBS[knob] = tuple(vals.split(","))
    block, base, fused, fpass = compiled_rank_block()
    rows = []
    for m in args.m:
        xs = decode_inputs(block, m)
        ref = fused(xs[0]).clone()
        knobs = {k: vals for k, vals in KNOBS.items()
                 if m <= ACTIVE_UP_TO.get(k, m) and (not args.knobs or k in args.knobs)}
        settings = {"defaults": {}} | {f"{k}={v}": {k: v} for k, vals in knobs.items() for v in vals} | combos
        samples: dict[str, list[float]] = {name: [] for name in ["compiled", *settings]}
        errs = {}
        for name, knobs in settings.items():
            with knobs_applied(knobs):
                errs[name] = rel_l2(fused(xs[0]), ref)
        for _ in range(args.rounds):
            samples["compiled"].append(_time(base, xs, {}))
            for name, knobs in settings.items():
                samples[name].append(_time(fused, xs, knobs))
        med = {name: statistics.median(v) for name, v in samples.items()}
        winners = {}
        for knob, vals in knobs.items():
            best = min(vals, key=lambda v: med[f"{knob}={v}"])
            if med[f"{knob}={best}"] < med["defaults"]:
                winners[knob] = best
        final = {"compiled": [], "defaults": [], "winners": []}
        for _ in range(args.rounds + 2):
            final["compiled"].append(_time(base, xs, {}))
            final["defaults"].append(_time(fused, xs, {}))
            final["winners"].append(_time(fused, xs, winners))
        with knobs_applied(winners):
            errs["winners"] = rel_l2(fused(xs[0]), ref)
        for name in settings:
            rows.append({"M": m, "setting": name, "us": med[name], "vs_defaults": med["defaults"] / med[name],
                         "vs_compiled": med["compiled"] / med[name], "rel_l2_vs_defaults": errs[name],
                         "matched": fpass.report.matched})
        fin = {k: statistics.median(v) for k, v in final.items()}
        rows.append({"M": m, "setting": "winners: " + (", ".join(f"{k}={v}" for k, v in winners.items()) or "none"),
                     "us": fin["winners"], "vs_defaults": fin["defaults"] / fin["winners"],
                     "vs_compiled": fin["compiled"] / fin["winners"], "rel_l2_vs_defaults": errs["winners"],
                     "matched": fpass.report.matched})
        rows.append({"M": m, "setting": "phase 2: defaults", "us": fin["defaults"], "vs_defaults": 1.0,
                     "vs_compiled": fin["compiled"] / fin["defaults"], "rel_l2_vs_defaults": 0.0,
                     "matched": fpass.report.matched})
        rows.append({"M": m, "setting": "compiled (no pass)", "us": fin["compiled"], "vs_defaults": float("nan"),
                     "vs_compiled": 1.0, "rel_l2_vs_defaults": float("nan"), "matched": 0})
        for r in rows[-3:]:
            print(r, flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584, H=7168, shared 768, "
                  "R=1, router GEMM bf16; compiled + fused block",
        "timing": f"CUDA graph replay over 4 rotating inputs; phase 1: median of {args.rounds} alternating rounds per "
                  f"setting; phase 2: median of {args.rounds + 2} rounds of compiled / defaults / winners",
    }
    write_results(args.name, rows, ["M", "setting", "us", "vs_defaults", "vs_compiled", "rel_l2_vs_defaults",
                                          "matched"], meta, args.out)


if __name__ == "__main__":
    main()
