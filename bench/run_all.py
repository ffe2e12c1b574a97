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
    ("tail.py", (), None),
    ("tail.py", ("--gemv", "--no-bench"), None),  # the few-token GEMV against swap-AB (tail_gemv.md)
    # CuTe tail tiles at decode sizes (tail_configs.TABLE's choice), then its pipeline depths
    ("tail_cute_sweep.py", (), "cutlass"),
    ("tail_cute_sweep.py", ("--full-only", "--stages", "6", "8", "9", "10", "12", "14", "16", "20", "24", "--rounds", "7",
                            "--name", "tail_cute_stages"), "cutlass"),
    ("tail_cute.py", ("--install-choice",), "cutlass"),  # and the per-bucket choice the package ships
    ("tail_cublas.py", (), None),  # after tail_cute: it compares cuBLAS addmm with the tail the op then picks
    ("producer.py", (), None),
    ("producer_shared_tiles.py", (), None),
    ("producer_weight_loads.py", (), None),
    ("producer_split_k.py", (), None),
    ("routed_regs.py", (), None),
    ("routed_ring.py", (), None),  # how the register-dequant kernels bring their weight words (loads, rings)
    # the TMA ring's load order, early against late, in alternating rounds
    ("routed_ring.py", ("--rings", "tma", "--orders", "early", "late", "--rounds", "3", "--name", "tma_load_order"), None),
    # the same for 16-row MMAs on the single-activation-buffer ring (this tree's), and L1's register cap at 32 rows
    ("routed_ring.py", ("--m", "8", "32", "--rings", "tma", "--orders", "early", "late", "--rounds", "3",
                        "--name", "tma_load_order_single"), None),
    ("routed_ring.py", ("--m", "128", "--rings", "tma", "--maxnreg", "auto", "128,auto", "136,auto", "--rounds", "3",
                        "--name", "routed_maxnreg"), None),
    ("routed_gemv.py", (), None),  # a few decode tokens' routed experts: CUDA-core GEMV against the MMA kernels
    ("routed_gemv_sass.py", (), None),  # static SASS of the GEMV kernels' K loop (no GPU needed)
    ("ncu_routed.py", (), "tool:ncu"),  # hardware counters of the routed L1 kernels (Nsight Compute)
    ("dequant_whatif.py", (), None),  # timing-only: the kernels with a cheaper (wrong) dequantiser, decode + prefill
    ("dequant_encodings.py", (), None),  # exhaustive: what a repacked word could save the dequantiser (no GPU needed)
    ("fp8_split_numerics.py", (), None),  # how far FP8 MMAs on split bf16 activations would move the numbers (CPU)
    ("routed_fp8.py", ("--variants", "pipe,8", "block,8", "pipe,16:128"), None),  # FP8 routed kernels
    ("fp8_sass.py", (), None),  # static SASS of the FP8 routed kernels (no GPU needed)
    ("regs_split.py", (), None),
    ("dequant_sass.py", (), None),  # static SASS of the Triton tiles' dequantisers (no GPU needed)
    ("regs_sass.py", (), None),
    ("shared_strategy.py", (), None),
    ("block.py", (), None),
    ("block_targets.py", (), None),  # what issue 6's targets ask of the routed op and of the rest (block.json; CPU)
    ("block_tp.py", (), "gpus:2"),  # the block over two GPUs with NCCL (TP and SP), communication included
    ("tp.py", (), "gpus:2"),  # fragment exchange and tail: symmetric-memory peer writes against NCCL
    ("host_gaps.py", (), None),  # why prefill wall time exceeds kernel time (GPU idle gaps)
    ("op_host_time.py", (), None),  # host time per op call, layer by layer
    ("router_gemm.py", (), None),  # the router GEMM at decode against its byte floor
    ("route.py", (), None),  # the router chain after its GEMM: unfused vs lmf::noaux_tc_route
    ("align_launch.py", (), None),  # the one-program token grouping by warps and pairs per step
    ("router_overlap.py", (), None),  # router GEMM + route beside the down-projection (lmf::route_and_project)
    ("down_projection.py", ("--configs", "swap_tma:16x32x256/w4/st6/s1", "swap:16x128x128/w4/st4/s4",
                            "swap_tma:32x64x256/w4/st4/s2", "swap_tma:64x64x128/w4/st6/s2"), None),  # alone vs cuBLAS
    ("prefill_tiles.py", (), None),  # prefill routed GEMM tile candidates and the spread token grouping
    ("prefill_regs.py", (), None),  # the routed op beyond decode: Triton tiles, register-dequant and staged kernels
    ("regs_block_rows.py", (), None),  # the register-dequant L1 / L2 in 32- and 64-row blocks, rings and caps
    ("regs_block_rows.py", ("--probes",), None),  # probes around the 64-row blocks the library did not take
    ("prefill_blocks.py", (), None),  # the staged 128-row blocks against the 64-row register-dequant blocks
    ("prefill_blocks.py", ("--staged-max-registers", "none", "--name", "prefill_blocks_one_cta"), None),  # 1 CTA / SM
    ("staged_sass.py", (), None),  # static SASS of the staged kernels' k loop (no GPU needed)
    ("ncu_staged.py", (), "tool:ncu"),  # hardware counters and stalls of the staged kernels (Nsight Compute)
    ("shared_in_line_order.py", (), None),  # the producer's in-line shared GEMMs before the grouping or after L1
    ("decode_tuning.py", (), None),  # decode knobs (PDL sites, prefetch, shared-expert programs, ...) on the block
    # the block with the bf16 routed kernels and with FP8 L1 and L2 against the default (the FP8 L1), in alternating rounds
    ("decode_tuning.py", ("--m", "8", "16", "32", "64", "128", "--knobs", "LMF_ROUTED_FP8", "--rounds", "5", "--name",
                          "decode_tuning_routed_fp8"), None),
    ("decode_tuning.py", ("--m", "1", "2", "4", "8", "16", "32", "64", "128", "--knobs", "shared_first_schedule", "--rounds",
                          "5", "--name", "decode_tuning_shared_first"), None),  # lmf::route_and_produce's schedule
    ("decode_tuning.py", ("--m", "8", "32", "128", "--knobs", "shared_first_order", "--rounds", "5", "--name",
                          "decode_tuning_shared_first_order"), None),  # its branches' launch order
    ("decode_tuning.py", ("--m", "8", "32", "64", "--knobs", "pdl_sites", "--values", "pdl_sites=none,routed", "--rounds",
                          "5", "--name", "decode_tuning_cute_tail_pdl"), None),  # the CuTe tail's dependent launch
    # lmf::route_and_produce's urgent streams and launch order against session 17's defaults
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
    ("prefill_timing.py", (), None),  # prefill timed as single synchronised calls or back to back
    ("prefill_timing.py", ("--precompile", "1", "8", "32", "128", "--name", "prefill_timing_precompiled"), None),
    ("graph_timeline.py", (), None),  # kernels of one replayed decode forward: start, duration, idle before
    ("capture_repeat.py", (), None),  # whether one CUDA-graph capture of the block runs like another
    ("shared_overlap_bound.py", (), None),  # what starting the shared expert before the router could save
    ("tail_prefetch_whatif.py", (), None),  # w_up streamed into L2 beside the routed kernels (a what-if)
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
