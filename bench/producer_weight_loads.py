"""How the MXFP4 producer loads and dequantises its routed weights, timed on the fused producer.

Four variants of the default tile config (`pick_config`) at every decode M and two prefill M:
  ptr/pairs  : per-element weight pointers, e2m1 -> bf16 by two-nibble PTX (today's default)
  tma/pairs  : weight tiles by host tensor descriptors (one TMA bulk copy per tile)
  ptr/lut    : table-lookup dequantiser (prmt), pointer loads
  tma/lut    : both
bench/dequant_sass.py predicts them from the static SASS of the K loop (3386 / 1591 / - / 1203
instructions per iteration in L1); this measures them. Each number is checked against the
reference op in the same run (rel. L2) before it counts.

    PYTHONPATH=. python3 bench/producer_weight_loads.py --out DIR [--quick]
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
from latent_moe_fusion.ops.routed.producer_config import ProducerConfig, pick_config  # noqa: E402
from latent_moe_fusion.ops.routed.triton.weight_tiles import DEQUANT_ASM_PAIRS, DEQUANT_LUT  # noqa: E402

VARIANTS = {"ptr/pairs": (False, DEQUANT_ASM_PAIRS), "tma/pairs": (True, DEQUANT_ASM_PAIRS),
            "ptr/lut": (False, DEQUANT_LUT), "tma/lut": (True, DEQUANT_LUT)}
DECODE_M, PREFILL_M = (1, 8, 32, 128), (512, 4096)
MAX_ERR = 1e-2


def variant(base: ProducerConfig, tma: bool, dequant: int) -> ProducerConfig:
    return replace(base, l1=replace(base.l1, tma=tma), l2=replace(base.l2, tma=tma), dequant=dequant)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--quick", action="store_true", help="M = 1, 32 and 512 only")
    args = ap.parse_args()
    ceil = measure_ceilings()
    bw = ceil["copy_bytes_per_s"]
    gen = torch.Generator().manual_seed(11)
    weights = make_weights("mxfp4", gen)
    shared_w = make_shared_weights()
    rms_w = make_rms_weight()
    ms = (1, 32, 512) if args.quick else DECODE_M + PREFILL_M
    rows = []
    for m in ms:
        case = Case(m, "mxfp4", weights, shared_w, rms_w, make_sets(m, 4 if m <= 128 else 2, gen))
        ry, rs = case.reference(0)
        hit = case.hit_experts()
        floor = floor_us(case, bw)
        base = pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS)
        row = {"M": m, "phase": "decode" if m in DECODE_M else "prefill", "experts_hit": hit, "floor_us": floor}
        for name, (tma, dq) in VARIANTS.items():
            cfg = variant(base, tma, dq)
            try:
                y, s = case.fused(0, cfg)
                err = max(rel_l2(y, ry), rel_l2(s, rs))
                us = time_graph_ms(lambda i, c=cfg: case.fused(i, c), len(case.sets)) * 1e3
            except Exception as exc:  # a variant that fails to build is a result, not the end of the run
                print(f"M={m} {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                err, us = float("nan"), float("inf")
            row[f"{name}_us"] = us if err < MAX_ERR else float("inf")
            row[f"{name}_err"] = err
        timed = {k.removesuffix("_us"): v for k, v in row.items() if k.endswith("_us") and k != "floor_us"}
        row["best"] = min(timed, key=timed.get)
        row["best_over_floor"] = timed[row["best"]] / floor
        row["best_vs_ptr_pairs"] = timed["ptr/pairs"] / timed[row["best"]]
        rows.append(row)
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    cols = (["phase", "M", "experts_hit"] + [f"{v}_us" for v in VARIANTS]
            + ["floor_us", "best", "best_over_floor", "best_vs_ptr_pairs"])
    meta = environment() | {
        "copy_TBps": round(bw / 1e12, 3),
        "config": f"MXFP4 fused producer, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} experts, top-{TOP_K}, L={LATENT}, "
                  f"H={HIDDEN}, I_s={INTER_S}; tiles of pick_config, weight loads and dequantiser varied"}
    write_results("producer_weight_loads", rows, cols, meta, args.out,
                  notes="Fused producer, CUDA-graph replay over rotating input sets (decode) / 2 sets (prefill), "
                        "us per call; inf: failed or rel. L2 error above 1e-2. floor: weights of the experts hit "
                        "+ shared weights + activations, once, over the measured copy bandwidth.")


if __name__ == "__main__":
    main()
