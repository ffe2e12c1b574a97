"""Hardware counters (Nsight Compute) of the routed experts' L1 kernels at decode: issue activity, the ALU and
FMA pipes, warps per SM and the stall reasons per issued instruction, for the CUDA-core GEMV (one to four
tokens) and the register-dequant wgmma kernels (the path from five tokens on; L1 and L2, with their weight
words by loads or through the default rings).

Each case runs this script again under `ncu --clock-control none` (the clocks stay as they are, see the
device notes) in driver mode: the routed op of bench/producer.py's Kimi K3 rank on two routings, the
second one profiled. ncu serialises kernels and flushes caches, so its durations are longer than the
timed ones (routed_gemv.md); the ratios are what this table is for.

    PYTHONPATH=. python3 bench/ncu_routed.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# mode: "default" / a GEMV setting (LMF_ROUTED_GEMV), or "mma" (the register-dequant kernels) with an optional
# weight ring after a colon (LMF_MXFP4_RING; none: the default rings)
CASES = (("1", "default"), ("1", "2x2x64w1p2r72"), ("4", "4x4x64w1p2"), ("8", "mma:loads"), ("8", "mma"),
         ("32", "mma:loads"), ("32", "mma"))
KERNELS = "routed_gemv_l1|l1_regs_kernel|l2_regs_kernel"
METRICS = ",".join((
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
    "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.per_cycle_active",
    "gpu__time_duration.sum", "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
))
COLUMNS = {"gpu__time_duration.sum": "ncu_us", "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
           "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active": "alu_pipe_pct",
           "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active": "fma_pipe_pct",
           "sm__warps_active.avg.per_cycle_active": "warps_per_sm",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct"}
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


NCU_TOOL = "ncu --clock-control none --page raw (durations: serialised, caches flushed)"
NCU_NOTES = ("issue_pct: issue slots busy (active cycles); alu_pipe_pct / fma_pipe_pct: instructions executed on those "
             "pipes against their peak; top_stalls: warp cycles stalled per issued instruction, by reason.")


def profile(script: str, kernels: str, metrics: str, driver_args: list[str], timeout: int = 600) -> str:
    """The raw page of `ncu` (clocks left as they are, only the launches between cudaProfilerStart and Stop) over
    `python script --driver *driver_args`, for the kernels whose names match the regex `kernels`."""
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "-k", f"regex:{kernels}", "--page", "raw",
           "--metrics", metrics, sys.executable, script, "--driver", *driver_args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"ncu failed for {' '.join(driver_args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def drive(m: int, mode: str) -> None:
    """The routed op on two routings; the second runs between cudaProfilerStart and Stop."""
    import torch

    from bench.producer import DT, LOCAL_EXPERTS, TOP_K, Case, make_rms_weight, make_shared_weights, make_weights
    from bench.producer_shared_tiles import one_token_sets
    from latent_moe_fusion.ops.routed.producer_config import pick_config

    gen = torch.Generator().manual_seed(29)
    case = Case(m, "mxfp4", make_weights("mxfp4", gen), make_shared_weights(), make_rms_weight(),
                one_token_sets(m, 2, gen))
    mode, _, ring = mode.partition(":")
    cfg = replace(pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS), routed_gemv=mode != "mma")
    if mode != "default":
        os.environ["LMF_ROUTED_GEMV"] = "0" if mode == "mma" else mode
    if ring:
        os.environ["LMF_MXFP4_RING"] = ring
    for i in range(3):
        case.routed_only(i % 2, cfg)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    case.routed_only(1, cfg)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def parse(text: str) -> list[dict]:
    """One row per profiled kernel of an `ncu --page raw` report: the named metrics and the stall reasons."""
    rows: list[dict] = []
    for line in text.splitlines():
        head = re.match(r"\s{2}(\w+) \(\d+, \d+, \d+\)x\((\d+), \d+, \d+\)", line)
        if head:
            rows.append({"kernel": head.group(1), "threads": int(head.group(2)), "stalls": {}})
            continue
        parts = line.split()
        if not rows or len(parts) < 2:
            continue
        value = parts[-1].replace(",", "")
        if parts[0] in COLUMNS:
            # ncu picks the duration's unit per kernel (ns, us, ms, s): the column is in us
            scale = _TO_US.get(parts[1], 1.0) if parts[0] == "gpu__time_duration.sum" and len(parts) == 3 else 1.0
            rows[-1][COLUMNS[parts[0]]] = float(value) * scale
        elif (stall := STALL.fullmatch(parts[0])) is not None:
            rows[-1]["stalls"][stall.group(1)] = float(value)
    return rows


def summarize(m: str, mode: str, text: str) -> list[dict]:
    """One row per kernel profiled (its last launch)."""
    rows = []
    for row in {r["kernel"]: r for r in parse(text)}.values():
        stalls = sorted(row.pop("stalls").items(), key=lambda kv: -kv[1])
        row = {"M": int(m), "variant": mode, **row}
        row["top_stalls"] = "; ".join(f"{name} {v:.2f}" for name, v in stalls[:5] if v >= 0.1)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--driver", nargs=2, metavar=("M", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--m", type=int, nargs="+", help="only the cases of these token counts")
    ap.add_argument("--name", default="routed_kernels_ncu")
    args = ap.parse_args()
    if args.driver:
        drive(int(args.driver[0]), args.driver[1])
        return
    from bench.common import environment, write_results

    rows = []
    for m, mode in CASES:
        if args.m and int(m) not in args.m:
            continue
        rows += summarize(m, mode, profile(__file__, KERNELS, METRICS, [m, mode]))
        print(rows[-1], flush=True)
    write_results(args.name, rows, ["M", "variant", "kernel", "threads", *COLUMNS.values(), "top_stalls"],
                  environment() | {"tool": NCU_TOOL}, args.out, notes=NCU_NOTES)


if __name__ == "__main__":
    main()
