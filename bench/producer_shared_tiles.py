"""Shared-expert tile of the MXFP4 decode producer: the fused producer timed per (rows x K) tile.

The shared gate/up GEMM reads H x 2 I_s BF16 weights (22 MB at Kimi K3's TP8 shard) in I_s / rows
programs, each streaming K = H; with the default 64-row tiles that is 12 programs, which at M = 1
finish long after the few routed experts do. Narrower, deeper tiles keep the shared memory per
stage and multiply the programs. Two routings: the producer benchmark's (the expert load of 8
global tokens per row) and a single token's (top-16 of 896 kept when local: ~2 of 112 experts per
token, as the block sees at decode).

    PYTHONPATH=. python3 bench/producer_shared_tiles.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.producer import (  # noqa: E402
    DT,
    GLOBAL_EXPERTS,
    HIDDEN,
    INTER_S,
    LATENT,
    LOCAL_EXPERTS,
    TOP_K,
    Case,
    make_rms_weight,
    make_sets,
    make_shared_weights,
    make_weights,
)
from latent_moe_fusion.ops.routed.producer_config import pick_config  # noqa: E402

TILES = ((64, 32), (32, 64), (32, 128), (16, 128), (16, 256))
DECODE_M = (1, 8, 32, 128)


def one_token_sets(m: int, n_sets: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    sets = make_sets(m, n_sets, gen)
    for s in sets:
        scores = torch.rand(m, GLOBAL_EXPERTS, generator=gen)
        top_s, top_i = scores.topk(TOP_K, dim=1)
        ids = torch.where(top_i < LOCAL_EXPERTS, top_i, -1).to(torch.int32)
        s["ids"], s["w"] = ids.cuda(), (top_s / top_s.sum(1, keepdim=True)).float().cuda()
    return sets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(7)
    weights = make_weights("mxfp4", gen)
    shared_w = make_shared_weights()
    rms_w = make_rms_weight()
    rows = []
    for routing, make in (("1 token/row", one_token_sets), ("8 tokens/row", make_sets)):
        for m in DECODE_M:
            case = Case(m, "mxfp4", weights, shared_w, rms_w, make(m, 4, gen))
            ry, rs = case.reference(0)
            base = pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS)
            row = {"routing": routing, "M": m, "experts_hit": case.hit_experts()}
            for bn_s, bk_s in TILES:
                cfg = replace(base, l1=replace(base.l1, bn_shared=bn_s, bk_shared=bk_s))
                y, s = case.fused(0, cfg)
                err = max(rel_l2(y, ry), rel_l2(s, rs))
                us = time_graph_ms(lambda i, c=cfg: case.fused(i, c), len(case.sets)) * 1e3
                row[f"{bn_s}x{bk_s}_us"] = us if err < 1e-2 else float("inf")
                row[f"{bn_s}x{bk_s}_err"] = err
            timed = {k: v for k, v in row.items() if k.endswith("_us")}
            row["best"] = min(timed, key=timed.get).removesuffix("_us")
            row["best_vs_64x32"] = row["64x32_us"] / timed[row["best"] + "_us"]
            rows.append(row)
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    cols = ["routing", "M", "experts_hit"] + [f"{a}x{b}_us" for a, b in TILES] + ["best", "best_vs_64x32"]
    meta = environment() | {"config": f"MXFP4 decode producer, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} experts, top-{TOP_K}, "
                                      f"L={LATENT}, H={HIDDEN}, I_s={INTER_S}; l1 shared tile rows x K varied"}
    write_results("producer_shared_tiles", rows, cols, meta, args.out,
                  notes="Fused producer (routed MXFP4 + BF16 shared + RMSNorm), CUDA-graph replay over 4 input "
                        "sets, us per call; inf: the variant's error exceeded 1e-2.")


if __name__ == "__main__":
    main()
