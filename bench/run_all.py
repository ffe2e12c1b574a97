"""`make bench`: run every benchmark on the GPU and regenerate bench/results/ (JSON, Markdown, PNG)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
# (script, extra arguments, module it needs beyond the base install, "tool:NAME" for a program, "gpus:N" for N GPUs
# of one host, or None)
BENCHMARKS = (
    # each op against its unfused form and its floor
    ("tail.py", (), None),
    ("tail.py", ("--gemv", "--no-bench"), None),  # the few-token GEMV against swap-AB (tail_gemv.md)
    ("tail_cute.py", ("--install-choice",), "cutlass"),  # CuTe against Triton, and the per-bucket choice the package ships
    ("producer.py", (), None),
    # the producer at prefill on the block's routing (ep_share) against its bytes and FLOP floors
    ("producer.py", ("--m", "4096", "8192", "16384", "32768", "--name", "producer_prefill"), None),
    ("routed_gemv.py", ("--specs", "2x2x64w1p2", "4x4x64w1p2"), None),  # one to four tokens: GEMV against the MMA path
    ("routed_fp8.py", ("--variants", "pipe,8", "block,8"), None),  # the FP8 L1 against the bf16 kernels at decode
    ("prefill_regs.py", (), None),  # the routed op beyond decode: Triton tiles, register-dequant and staged kernels
    ("route.py", (), None),  # the router chain after its GEMM: unfused vs lmf::noaux_tc_route
    ("router_overlap.py", (), None),  # router GEMM + route beside the down-projection (lmf::route_and_project)
    ("down_projection.py", ("--configs", "swap_tma:16x32x256/w4/st6/s1", "swap:16x128x128/w4/st4/s4",
                            "swap_tma:32x64x256/w4/st4/s2", "swap_tma:64x64x128/w4/st6/s2"), None),  # alone vs cuBLAS
    # the block: one rank, then what its targets ask of each part (block.json; CPU), then over two GPUs
    ("block.py", (), None),
    ("peer_routed.py", (), None),  # ours against triton_kernels' MXFP4 MoE as vLLM runs it (exits 0 if .peer is absent)
    ("block_targets.py", (), None),
    ("block_tp.py", (), "gpus:2"),  # the block over two GPUs with NCCL (TP and SP), communication included
    ("block_tp.py", ("--world", "4"), "gpus:4"),  # and over four, eight (block_tp_4gpu.*, block_tp_8gpu.*)
    ("block_tp.py", ("--world", "8"), "gpus:8"),
    ("tp.py", (), "gpus:2"),  # fragment exchange and tail: symmetric-memory peer writes against NCCL
    # the decode defaults against their alternatives on the whole block, in alternating rounds
    ("decode_tuning.py", ("--m", "8", "16", "32", "64", "128", "--knobs", "LMF_ROUTED_FP8", "--rounds", "5", "--name",
                          "decode_tuning_routed_fp8"), None),  # bf16 kernels, FP8 L1 (default), FP8 L1 + L2
    ("decode_tuning.py", ("--m", "1", "2", "4", "8", "16", "32", "64", "128", "--knobs", "shared_first_schedule", "--rounds",
                          "5", "--name", "decode_tuning_shared_first"), None),  # lmf::route_and_produce's schedule
    # its urgent streams and launch order against the plain-priority orders
    ("decode_tuning.py", ("--m", "8", "16", "32", "64", "128", "--knobs", "shared_first_urgent",
                          "shared_first_order", "--rounds", "5", "--name", "decode_tuning_shared_first_urgent",
                          "--combo", "shared_first_urgent=none;shared_first_order=router,down,shared",
                          "shared_first_urgent=none;shared_first_order=shared,router,down"), None),
    # the down-projection's kernel in the block: cuBLAS, the Triton table, and single configs over several buckets
    ("decode_tuning.py", ("--m", "1", "2", "4", "8", "16", "32", "64", "--knobs", "LMF_DOWN_PROJECTION",
                          "down_projection_kernel", "--rounds", "7", "--name", "decode_tuning_down_triton", "--values",
                          "LMF_DOWN_PROJECTION=cublas,triton",
                          "down_projection_kernel=swap_tma:16x32x256/w4/st6/s1,swap:16x64x128/w4/st6/s2,"
                          "swap_tma:32x32x256/w4/st6/s1"), None),
    # tools: the kernels of one replayed decode forward, and the GPU's idle gaps of a prefill forward
    ("graph_timeline.py", ("--m", "1", "8", "32", "128", "--fused-knobs", "pdl_sites=none"), None),
    # the accuracy cost of FP8 activations (W4A8) on the routed experts, before a kernel (runs on the CPU)
    ("w4a8_numerics.py", (), None),
    ("w4a8_routed.py", (), None),  # the opt-in W4A8 prefill path against the default, M = 4096 .. 32768
    ("prefill_kernels.py", (), None),  # the kernels of the 128-row blocks: staged, kappa (default), warp-specialised
    ("prefill_profile.py", (), None),  # their hardware counters and stall reasons (Nsight Compute)
    # the same at prefill: which kernels run beside which (none do at M = 4096)
    ("graph_timeline.py", ("--m", "4096", "--fused-knobs", "pdl_sites=none", "--name", "graph_timeline_prefill"), None),
    ("host_gaps.py", (), None),
    # a peer: the routed experts on DeepGEMM's SM90 grouped GEMMs (opt-in backend)
    ("deepgemm_routed.py", ("--weight-format", "mxfp4"), "deep_gemm"),
    ("deepgemm_routed.py", ("--weight-format", "bf16"), "deep_gemm"),
)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("make bench needs a CUDA GPU (the figures are for an H200); nothing was run.")
        return 1
    env = dict(os.environ, PYTHONPATH=str(BENCH_DIR.parent), PYTHONUNBUFFERED="1")
    failed = []
    for name, extra, needs in BENCHMARKS:
        script = BENCH_DIR / name
        if needs is not None and needs.startswith("gpus:"):
            if torch.cuda.device_count() < int(needs[5:]):
                print(f"== {name} skipped: needs {needs[5:]} GPUs, this machine has {torch.cuda.device_count()}",
                      flush=True)
                continue
        elif needs is not None and needs.startswith("tool:"):
            if shutil.which(needs[5:]) is None:
                print(f"== {name} skipped: {needs[5:]!r} is not on the PATH", flush=True)
                continue
        elif needs is not None and importlib.util.find_spec(needs) is None:
            print(f"== {name} skipped: the optional module {needs!r} is not installed", flush=True)
            continue
        print(f"== {name} {' '.join(extra)}", flush=True)
        if subprocess.call([sys.executable, str(script), "--out", str(BENCH_DIR / "results"), *extra], env=env):
            failed.append(f"{name} {' '.join(extra)}".strip())
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
