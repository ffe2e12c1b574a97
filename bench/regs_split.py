"""K slices of the Gluon register-dequant routed kernels for a single decode token.

One token reaches ~2 of a rank's 112 experts: L1 then has ~96 programs and L2 ~56 on 132 SMs, each
streaming a whole K with one step of loads in flight, far from the copy bandwidth. Cutting K into
slices multiplies the programs; L1 writes FP32 gate/up slice sums (plus an ordered-sum + SiTU
finish), L2 FP32 slice rows that the combine adds in order. This sweeps the (L1, L2) slice counts
on the routed op alone and on the producer (shared expert on its side stream, RMSNorm), by CUDA-graph
replay over rotating inputs; the per-kernel times come from the profiler. Floors: MXFP4 bytes of the
experts hit over the measured copy bandwidth.

    PYTHONPATH=. python3 bench/regs_split.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.producer import GLOBAL_EXPERTS, LOCAL_EXPERTS, TOP_K  # noqa: E402
from bench.routed_regs import decode_cases, routed_kernel_us  # noqa: E402

SPLITS = ((1, 1), (2, 2), (2, 4), (4, 2), (4, 4), (7, 3), (4, 6), (7, 6), (14, 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=[1])
    ap.add_argument("--splits", nargs="+", default=[f"{a}x{b}" for a, b in SPLITS], help="L1xL2 slice counts")
    args = ap.parse_args()
    bw = measure_ceilings()["copy_bytes_per_s"]
    splits = [tuple(int(v) for v in name.split("x")) for name in args.splits]
    rows = []
    for dc in decode_cases(args.m, 29, bw):
        case = dc.case
        assert dc.picked.routed_regs, "needs the register-dequant path (sm_90, mxfp4_regs override not False)"
        for split in splits:
            cfg = replace(dc.picked, regs_split=split)
            row = {"routing": dc.routing, "M": dc.m, "split": f"{split[0]}x{split[1]}", "experts_hit": dc.hit,
                   "picked": split == dc.picked.regs_split,
                   "l1_floor_us": dc.l1_floor_us, "l2_floor_us": dc.l2_floor_us,
                   "err": rel_l2(case.routed_only(0, cfg), dc.ref)}
            row["routed_us"] = time_graph_ms(lambda i, c=cfg: case.routed_only(i, c), len(case.sets)) * 1e3
            row["producer_us"] = time_graph_ms(lambda i, c=cfg: case.fused(i, c), len(case.sets)) * 1e3
            times = routed_kernel_us(case, cfg)
            row["l1_us"] = times.get("l1_regs_kernel", float("nan")) + times.get("l1_finish_kernel", 0.0)
            row["l2_us"] = times.get("l2_regs_kernel", float("nan"))
            row["combine_us"] = times.get("combine_kernel", float("nan"))
            row["l1_x_floor"] = row["l1_us"] / row["l1_floor_us"]
            row["l2_x_floor"] = row["l2_us"] / row["l2_floor_us"]
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    cols = ["routing", "M", "split", "picked", "experts_hit", "routed_us", "producer_us", "l1_us", "l1_floor_us",
            "l1_x_floor", "l2_us", "l2_floor_us", "l2_x_floor", "combine_us", "err"]
    meta = environment() | {
        "copy_TBps": round(bw / 1e12, 3),
        "config": f"routed MXFP4 experts, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} local, top-{TOP_K}, Kimi K3 rank sizes; "
                  "pick_config tiles with regs_split replaced"}
    write_results("regs_split", rows, cols, meta, args.out,
                  notes="split: K slices L1xL2. routed_us: the routed op; producer_us: routed + shared expert + "
                        "RMSNorm (shared on its side stream); CUDA-graph replay over 4 rotating input sets. l1_us "
                        "includes the split finish kernel; profiler kernel times. err: rel. L2 vs routed_experts_math.")


if __name__ == "__main__":
    main()
