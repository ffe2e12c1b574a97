"""Split-K for the decode producer: the fused MXFP4 producer timed per (L1, L2) K-slice count.

At decode a token reaches ~2 of a rank's 112 experts, so the unsplit L1 runs ~100 routed programs
(+ the shared ones), about one 4-warp CTA per SM, each streaming K = 3584 alone; the block's
profile (block_kernels.md, M = 1) has it at ~5x its bytes' floor. Slicing K multiplies the programs
at the cost of FP32 partials (L1: SiTU after the ordered sum, ops/routed/split_k_finish.py; L2: summed by the combine).
Two routings, as in producer_shared_tiles.py: one token per row (what the block sees at decode) and
the producer benchmark's 8 global tokens per row.

    PYTHONPATH=. python3 bench/producer_split_k.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.producer import (  # noqa: E402
    DT,
    GLOBAL_EXPERTS,
    HIDDEN,
    INTER_S,
    LATENT,
    LOCAL_EXPERTS,
    TOP_K,
    Case,
    floor_us,
    make_rms_weight,
    make_sets,
    make_shared_weights,
    make_weights,
)
from bench.producer_shared_tiles import one_token_sets  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import pick_config  # noqa: E402

SPLITS = ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4))
DECODE_M = (1, 8, 32, 128)
MAX_ERR = 1e-2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=list(DECODE_M))
    args = ap.parse_args()
    bw = measure_ceilings()["copy_bytes_per_s"]
    gen = torch.Generator().manual_seed(17)
    weights = make_weights("mxfp4", gen)
    shared_w = make_shared_weights()
    rms_w = make_rms_weight()
    rows = []
    for routing, make in (("1 token/row", one_token_sets), ("8 tokens/row", make_sets)):
        for m in args.m:
            case = Case(m, "mxfp4", weights, shared_w, rms_w, make(m, 4, gen))
            ry, rs = case.reference(0)
            hit = case.hit_experts()
            floor = floor_us(case, bw)
            base = pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS)
            row = {"routing": routing, "M": m, "experts_hit": hit, "floor_us": floor}
            for s1, s2 in SPLITS:
                cfg = replace(base, l1=replace(base.l1, split_k=s1), l2=replace(base.l2, split_k=s2))
                y, s = case.fused(0, cfg)
                err = max(rel_l2(y, ry), rel_l2(s, rs))
                us = time_graph_ms(lambda i, c=cfg: case.fused(i, c), len(case.sets)) * 1e3
                row[f"{s1}x{s2}_us"] = us if err < MAX_ERR else float("inf")
                row[f"{s1}x{s2}_err"] = err
            timed = {k.removesuffix("_us"): v for k, v in row.items() if k.endswith("_us") and k != "floor_us"}
            row["best"] = min(timed, key=timed.get)
            row["best_vs_1x1"] = timed["1x1"] / timed[row["best"]]
            row["best_over_floor"] = timed[row["best"]] / floor
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    cols = (["routing", "M", "experts_hit"] + [f"{a}x{b}_us" for a, b in SPLITS]
            + ["floor_us", "best", "best_vs_1x1", "best_over_floor"])
    meta = environment() | {
        "copy_TBps": round(bw / 1e12, 3),
        "config": f"MXFP4 decode producer, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} experts, top-{TOP_K}, L={LATENT}, "
                  f"H={HIDDEN}, I_s={INTER_S}; pick_config tiles, K slices (L1 x L2) varied"}
    write_results("producer_split_k", rows, cols, meta, args.out,
                  notes="Fused producer, CUDA-graph replay over 4 rotating input sets, us per call; column AxB: L1 "
                        "in A K slices, L2 in B; inf: rel. L2 error above 1e-2. floor: weights of the experts hit + "
                        "shared weights + activations, once, over the measured copy bandwidth.")


if __name__ == "__main__":
    main()
