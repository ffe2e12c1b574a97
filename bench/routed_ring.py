"""How the Gluon register-dequant kernels (ops/routed/gluon/routed_gemm.py) bring their weight words.

The kernels' weight words either arrive by 16-byte loads one k step ahead ("loads": bytes in flight
bounded by registers) or stream through a ring of shared-memory stages filled per thread by cp.async
("cp2", "cp4") or by TMA ("tma"): k steps in flight independent of registers. Same inputs as routed_regs.py (one token per row, the Kimi K3 rank's
share at decode); every variant's output must be bitwise the first one's (same MMA order, same
dequantisation). The routed op is timed by CUDA-graph replay over rotating input sets, L1 / L2 per
kernel by the profiler, each against its floor (MXFP4 bytes of the experts hit / copy bandwidth).

    PYTHONPATH=. python3 bench/routed_ring.py --out DIR [--m 8 32 128] [--rings loads tma,cp4] [--split 1,1 2,1]
        [--orders early late] [--maxnreg auto 128,auto] [--rounds 3] [--name NAME]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import env_applied, environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.producer import GLOBAL_EXPERTS, INTER, LATENT, LOCAL_EXPERTS, TOP_K  # noqa: E402
from bench.routed_regs import decode_cases, routed_kernel_us  # noqa: E402
from latent_moe_fusion.ops.routed.gluon import LOAD_ORDER_ENV, LOAD_ORDERS, MAXNREG_ENV, RING_ENV  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--rings", nargs="+", default=["loads", "cp2", "cp4", "tma", "tma,cp4"],
                    help=f"{RING_ENV} values (L1 and L2 alike, or L1,L2); the first is the bitwise reference")
    ap.add_argument("--split", nargs="+", default=["1,1"], help="K slices of L1,L2 (ProducerConfig.regs_split), "
                    "each with every ring")
    ap.add_argument("--orders", nargs="+", default=["auto"], choices=LOAD_ORDERS,
                    help=f"{LOAD_ORDER_ENV} values (the TMA ring's load order), each with every ring")
    ap.add_argument("--maxnreg", nargs="+", default=["auto"],
                    help=f"{MAXNREG_ENV} values (L1,L2 register caps), each with every ring")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds over the variants; medians reported")
    ap.add_argument("--name", default="routed_ring")
    args = ap.parse_args()
    bw = measure_ceilings()["copy_bytes_per_s"]
    rows = []
    for dc in decode_cases(args.m, 23, bw):
        if dc.routing != "1 token/row" or dc.m not in args.m:
            continue
        variants = [(split, ring, order, cap) for split in args.split for ring in args.rings for order in args.orders
                    for cap in args.maxnreg]
        samples: dict[tuple, list] = {v: [] for v in variants}
        outs, base = {}, {}
        for _ in range(args.rounds):
            for split_arg, ring, order, cap in variants:
                split = tuple(int(v) for v in split_arg.split(","))
                case, cfg = dc.case, replace(dc.picked, routed_regs=True, routed_gemv=False, regs_split=split)
                with env_applied({RING_ENV: ring, LOAD_ORDER_ENV: order, MAXNREG_ENV: cap}):
                    out = case.routed_only(0, cfg)
                    torch.cuda.synchronize()
                    outs[split_arg, ring, order, cap] = out.clone()
                    base.setdefault(split_arg, outs[split_arg, ring, order, cap])
                    us = time_graph_ms(lambda i: case.routed_only(i, cfg), len(case.sets)) * 1e3
                    times = routed_kernel_us(case, cfg)
                # L1 with its K-slice finish (ordered slice sum + SiTU) where split
                samples[split_arg, ring, order, cap].append(
                    (us, times.get("l1_regs_kernel", float("nan")) + times.get("l1_finish_kernel", 0.0),
                     times.get("l2_regs_kernel", float("nan"))))
        for split_arg, ring, order, cap in variants:
            us, l1, l2 = (statistics.median(x[i] for x in samples[split_arg, ring, order, cap]) for i in range(3))
            out = outs[split_arg, ring, order, cap]
            row = {"M": dc.m, "ring": ring, "split": split_arg, "order": order, "maxnreg": cap, "experts_hit": dc.hit, "routed_us": us,
                   "l1_us": l1, "l2_us": l2, "l1_floor_us": dc.l1_floor_us, "l2_floor_us": dc.l2_floor_us,
                   "l1_x_floor": l1 / dc.l1_floor_us, "l2_x_floor": l2 / dc.l2_floor_us,
                   "bitwise_first": bool(torch.equal(out, base[split_arg])), "err": rel_l2(out, dc.ref)}
            rows.append(row)
            print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    cols = ["M", "ring", "split", "order", "maxnreg", "experts_hit", "routed_us", "l1_us", "l1_floor_us", "l1_x_floor", "l2_us", "l2_floor_us",
            "l2_x_floor", "bitwise_first", "err"]
    meta = environment() | {
        "copy_TBps": round(bw / 1e12, 3),
        "config": f"routed MXFP4 experts, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} local, top-{TOP_K}, L={LATENT}, I={INTER}; "
                  "one token per row; pick_config tiles, register-dequant kernels"}
    write_results(args.name, rows, cols, meta, args.out,
                  notes="ring: how L1 (and L2, or L1,L2) bring their weight words (routed.gluon.WEIGHT_RINGS: "
                        "loads = 16-byte loads one k step ahead; cp2 / cp4 = cp.async ring of 2 / 4 shared-memory "
                        "stages; tma = TMA ring of 4 stages). split: K slices of L1,L2. order: the TMA ring's load order (routed.gluon.LOAD_ORDERS: when a step issues the next step's scales and activation tile; auto: late for 32-row MMAs, early for 16-row ones). maxnreg: the L1,L2 register caps (gluon_kernels.MAXNREG_ENV; auto: max_registers). Times: medians over the alternating rounds. routed_us: the routed op (grouping, L1, L2, combine), CUDA-graph replay "
                        "over 4 rotating input sets. l1_us / l2_us: profiler kernel time. Floors: MXFP4 codes + "
                        "scales of the experts hit over the measured copy bandwidth. bitwise_first: output equal "
                        "to the first variant's bit for bit (every ring and order, same split). err: rel. L2 vs routed_experts_math (FP32).")


if __name__ == "__main__":
    main()
