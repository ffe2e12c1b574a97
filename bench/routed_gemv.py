"""Routed MXFP4 experts for a few decode tokens: the register-dequant MMA kernels (grouping, L1 in K slices,
finish, L2) against the CUDA-core GEMV kernels (ops/routed/routed_gemv.py, Gluon on sm_90), on the
same inputs, for several GEMV shapes (routed_gemv tuning override specs).

The routed op alone (routing to combine) is timed by CUDA-graph replay over rotating input sets; the
kernels by the profiler. Floor: the MXFP4 bytes (codes + E8M0 scales) of the (token, expert) pairs'
weights once over the measured copy bandwidth (the GEMV reads an expert once per pair that uses it; with
one token per row the pairs' experts are distinct). Routing: a rank of the Kimi K3 block at decode (top-16
of 896, the slots of this rank's 112 experts valid).

    PYTHONPATH=. python3 bench/routed_gemv.py --out DIR [--m 1 2 4 8] [--specs 4x4x64w1p2 ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.kernel_breakdown import kernel_times_us  # noqa: E402
from bench.producer import (  # noqa: E402
    DT,
    GLOBAL_EXPERTS,
    INTER,
    LATENT,
    LOCAL_EXPERTS,
    TOP_K,
    Case,
    make_rms_weight,
    make_shared_weights,
    make_weights,
)
from bench.routed_inputs import L1_BYTES, L2_BYTES, one_token_sets  # noqa: E402
from latent_moe_fusion import tuning  # noqa: E402
from latent_moe_fusion.ops.common.reference_math import routed_experts_math  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import pick_config  # noqa: E402
from latent_moe_fusion.ops.routed.routed_gemv import ROUTED_GEMV_CONFIG  # noqa: E402

SPECS = ("4x4x64w1p2", "4x4x64w1p1", "4x4x64w1p4", "2x2x64w1p2", "8x8x64w1p2", "4x4x64w2p2", "4x4x128w1p2",
         "4x4x64w1p2b")


def _spec(c) -> str:
    return f"{c.l1_rows}x{c.l2_rows}x{c.words}w{c.num_warps}p{c.pair_programs}" + ("" if c.scale_sums else "b") + (
        "f" if c.prefetch else "") + (f"r{c.max_registers}" if c.max_registers else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--specs", nargs="+", default=list(SPECS))
    ap.add_argument("--name", default="routed_gemv")
    args = ap.parse_args()
    bw = measure_ceilings()["copy_bytes_per_s"]
    gen = torch.Generator().manual_seed(29)
    weights = make_weights("mxfp4", gen)
    shared_w, rms_w = make_shared_weights(), make_rms_weight()
    rows = []
    for m in args.m:
        case = Case(m, "mxfp4", weights, shared_w, rms_w, one_token_sets(m, 4, gen))
        picked = pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS)
        ref = routed_experts_math(*case.routed_args(case.sets[0]))
        pairs = case.pairs()
        floor_us = pairs * (L1_BYTES + L2_BYTES) / bw * 1e6
        variants = {"mma": (False, replace(picked, routed_gemv=False))}  # name: (routed_gemv override, config)
        variants |= {f"gemv {s}": (s, replace(picked, routed_gemv=True)) for s in args.specs}
        for name, (setting, cfg) in variants.items():
            with tuning.overrides(routed_gemv=setting):
                err = rel_l2(case.routed_only(0, cfg), ref)
                us = time_graph_ms(lambda i, c=cfg: case.routed_only(i, c), len(case.sets)) * 1e3
                sets = itertools.cycle(range(len(case.sets)))
                kernels = kernel_times_us(lambda c=cfg: case.routed_only(next(sets), c), iters=8, top=12)
            row = {"M": m, "variant": name, "pairs": pairs, "us": us, "floor_us": floor_us, "x_floor": us / floor_us,
                   "err": err, "kernels": "; ".join(f"{k[:28]} {v:.1f}" for k, v in kernels if not k.startswith("("))}
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    meta = environment() | {
        "copy_TBps": round(bw / 1e12, 3), "default_gemv": _spec(ROUTED_GEMV_CONFIG),
        "config": f"routed MXFP4 experts, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} local, top-{TOP_K}, L={LATENT}, I={INTER}; "
                  "one token per row (a rank's EP share)"}
    write_results(args.name, rows, ["M", "variant", "pairs", "us", "floor_us", "x_floor", "err", "kernels"], meta,
                  args.out, notes="us: the routed op (routing to combine), CUDA-graph replay over 4 rotating input "
                                  "sets. floor: MXFP4 bytes of the valid pairs' experts (L1 + L2) once over the copy "
                                  "bandwidth. gemv specs: L1ROWSxL2ROWSxWORDS wWARPS pPAIR_PROGRAMS, b = scales in "
                                  "bf16 before the FMAs. kernels: profiler us per call.")


if __name__ == "__main__":
    main()
