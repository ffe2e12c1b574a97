"""Hardware counters (Nsight Compute) of the routed op's prefill kernels: what bounds them.

One EP8 rank of Kimi K3 (bench/peer_inputs.py: 112 of 896 MXFP4 experts, top-16, L = 3584, I = 3072). Each case
runs this script again under `ncu --clock-control none` (the clocks stay as the device notes ask) in driver mode:
lmf::routed_experts on one routing, warmed up, then once between cudaProfilerStart and Stop; ncu profiles the
routed kernels of that call (the kappa gather, L1, L2; on the W4A8 path its L1 and L2). Per kernel: issue activity,
warps per scheduler (active, eligible, issued), the tensor pipe's and shared memory's activity, DRAM throughput, and
the warp stall reasons in cycles per issued instruction. ncu serialises kernels and flushes caches, so its durations
are longer than the timed ones (prefill_kernels.md, w4a8_routed.md): the ratios are what this table is for.

    PYTHONPATH=. python bench/prefill_profile.py --out bench/results [--cases 4096:kappa 16384:kappa 16384:w4a8]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, environment, write_results  # noqa: E402

# variant: the routed op's default ("kappa": the kappa kernels on the 128-row blocks) or the opt-in W4A8 path
VARIANT_ENV = {"kappa": {}, "w4a8": {"LMF_ROUTED_W4A8": "1"}}
DEFAULT_CASES = ("4096:kappa", "16384:kappa", "32768:kappa", "16384:w4a8")
KERNELS = ("gather_kappa_rows_kernel|l1_kappa_kernel|l2_kappa_kernel|quantize_1x128_kernel|l1_w4a8_kernel|"
           "l2_w4a8_kernel")
METRICS = ",".join((
    "gpu__time_duration.sum",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__warps_active.avg.per_cycle_active",
    "smsp__warps_eligible.avg.per_cycle_active",
    "smsp__inst_executed.avg.per_cycle_active",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    r"regex:sm__pipe_tensor_op_.*_cycles_active\.avg\.pct_of_peak_sustained_active",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio",
))
COLUMNS = {
    "gpu__time_duration.sum": "ncu_us",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "smsp__warps_active.avg.per_cycle_active": "active_warps",
    "smsp__warps_eligible.avg.per_cycle_active": "eligible_warps",
    "smsp__inst_executed.avg.per_cycle_active": "issued_per_cycle",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed": "shared_pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "launch__registers_per_thread": "registers",
}
TABLE = ["M", "variant", "kernel", "ncu_us", "tensor_pipe_pct", "issue_pct", "active_warps", "eligible_warps",
         "issued_per_cycle", "sm_pct", "shared_pct", "dram_pct", "registers", "cycles_per_issue", "top_stalls"]
_TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")
TENSOR = re.compile(r"sm__pipe_tensor_op_(\w+)_cycles_active\.avg\.pct_of_peak_sustained_active")
NCU_TOOL = "ncu --clock-control none --page raw (durations: serialised, caches flushed)"
NOTES = ("Per scheduler (4 a SM): active_warps resident, eligible_warps ready to issue, issued_per_cycle issued. "
         "tensor_pipe_pct: cycles the wgmma pipe was busy against its peak (active cycles); shared_pct: shared-memory "
         "wavefronts against their peak. cycles_per_issue: a warp's cycles between two issues, the sum of its stall "
         "reasons; top_stalls: the largest of them in those cycles.")


def profile(case: str, timeout: int = 900) -> str:
    """ncu's raw page over this script in driver mode for one case (M:variant)."""
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "-k", f"regex:{KERNELS}", "--page", "raw",
           "--metrics", METRICS, sys.executable, __file__, "--driver", case]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"ncu failed for {case}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def drive(case: str) -> None:
    """The routed op on one routing: two warm-up calls, then one between cudaProfilerStart and Stop."""
    import torch

    import latent_moe_fusion  # noqa: F401  (registers lmf::routed_experts)
    from bench.peer_inputs import rank_inputs, rank_weights, routed_with_knobs

    m, variant = _case(case)
    os.environ.update(VARIANT_ENV[variant])
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = rank_weights(gen, "cuda")
    s = rank_inputs(m, gen, "cuda")
    call = routed_with_knobs(w, {})
    for _ in range(2):
        call(s.z, s.ids, s.weights)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call(s.z, s.ids, s.weights)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _case(case: str) -> tuple[int, str]:
    m, _, variant = case.partition(":")
    if variant not in VARIANT_ENV or not m.isdigit():
        raise SystemExit(f"a case is M:variant with variant one of {', '.join(VARIANT_ENV)}, got {case!r}")
    return int(m), variant


def parse(text: str) -> list[dict]:
    """One row per profiled kernel of an `ncu --page raw` report: the named metrics and the stall reasons."""
    rows: list[dict] = []
    for line in text.splitlines():
        head = re.match(r"\s{2}(\w+) \(\d+, \d+, \d+\)x\((\d+), \d+, \d+\)", line)
        if head:
            rows.append({"kernel": head.group(1), "threads": int(head.group(2)), "stalls": {}, "tensor_pipes": {}})
            continue
        parts = line.split()
        if not rows or len(parts) < 2:
            continue
        value = parts[-1].replace(",", "")
        try:
            number = float(value)
        except ValueError:
            continue
        if parts[0] in COLUMNS:
            # ncu picks the duration's unit per kernel (ns, us, ms, s): the column is in us
            scale = _TO_US.get(parts[1], 1.0) if parts[0] == "gpu__time_duration.sum" and len(parts) == 3 else 1.0
            rows[-1][COLUMNS[parts[0]]] = number * scale
        elif (stall := STALL.fullmatch(parts[0])) is not None:
            rows[-1]["stalls"][stall.group(1)] = number
        elif (pipe := TENSOR.fullmatch(parts[0])) is not None:
            rows[-1]["tensor_pipes"][pipe.group(1)] = number
    return rows


def summarize(case: str, text: str) -> list[dict]:
    """One row per kernel profiled: its metrics, the cycles between a warp's issues and the five largest stalls."""
    m, variant = _case(case)
    rows = []
    for row in parse(text):
        stalls = row.pop("stalls")
        # the wgmma's pipe (gmma on sm_90; the largest tensor pipe where ncu names it otherwise)
        pipes = row["tensor_pipes"]
        row["tensor_pipe_pct"] = pipes.get("gmma", max(pipes.values(), default=float("nan")))
        # "selected" is the issue cycle itself; the rest are the cycles a warp waited, by reason
        top = sorted(((k, v) for k, v in stalls.items() if k != "selected"), key=lambda kv: -kv[1])
        row = {"M": m, "variant": variant, **row, "cycles_per_issue": round(sum(stalls.values()), 2),
               "top_stalls": "; ".join(f"{name} {v:.2f}" for name, v in top[:5] if v >= 0.05), "stalls": stalls}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="M:variant (variant: kappa or w4a8)")
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.driver:
        drive(args.driver)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("prefill_profile: needs a CUDA GPU (sm_90) and Nsight Compute (ncu)")
        return 0
    rows = []
    for case in args.cases:
        text = profile(case)
        found = summarize(case, text)
        if not found:
            raise SystemExit(f"ncu profiled no kernel for {case}; its report ends:\n{text[-3000:]}")
        rows += found
        for r in found:
            print({k: v for k, v in r.items() if k != "stalls"}, flush=True)
    meta = {"shape": "one EP8 rank of Kimi K3: 112 of 896 MXFP4 experts, top-16 (other ranks' experts -1), "
                     "L=3584, I=3072, z BF16", "tool": NCU_TOOL, "environment": environment()}
    write_results("prefill_profile", rows, TABLE, meta, args.out, notes=NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
