"""Hardware counters (Nsight Compute) of the staged prefill kernels (ops/routed/gluon/routed_staged.py): issue
activity, pipes, tensor-pipe activity, eligible warps, shared-memory bank conflicts and the stall reasons per
issued instruction, for L1 and L2 on a routing of the Kimi K3 rank (bench/prefill_regs.routing) at M tokens.

Runs itself again under `ncu --clock-control none` in driver mode (the clocks stay as they are); the kernels'
third launch is profiled. ncu serialises kernels and flushes caches: read the ratios, not the durations.

    PYTHONPATH=. python3 bench/ncu_staged.py --out DIR [--m 4096] [--routing ep_share]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.ncu_routed import COLUMNS, METRICS, NCU_NOTES, NCU_TOOL, profile, summarize  # noqa: E402

EXTRA = {"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pipe_pct",
         "smsp__warps_eligible.avg.per_cycle_active": "eligible_warps",
         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum": "smem_bank_conflicts"}


def drive(m: int, kind: str) -> None:
    import torch

    from bench.block import kimi_rank_block
    from bench.prefill_regs import routing
    from latent_moe_fusion.ops.routed.gluon import STAGED_BLOCK_ROWS, launch_routed_l1, launch_routed_l2
    from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert

    torch.manual_seed(0)
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    ids, _, z = routing(block, m, kind)
    bm = STAGED_BLOCK_ROWS
    g = group_by_expert(ids, block.num_local_experts, bm)
    act = torch.zeros((g.nb_max * bm, cfg.moe_intermediate_size), dtype=torch.bfloat16, device="cuda")
    pairs = torch.zeros((ids.numel(), cfg.latent_size), dtype=torch.float32, device="cuda")

    def run() -> None:
        launch_routed_l1(z, block.w13, block.w13_scale, g.sorted_pairs, g.block_expert, act, g.nb_max, bm, cfg.top_k,
                         cfg.situ_beta, cfg.situ_linear_beta)
        launch_routed_l2(act, block.w2, block.w2_scale, g.sorted_pairs, g.block_expert, pairs, g.nb_max, bm)

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def extra_values(text: str) -> list[dict]:
    """The EXTRA metrics per profiled kernel, in report order."""
    rows: list[dict] = []
    for line in text.splitlines():
        parts = line.split()
        if line.startswith("  ") and "(" in line and "x(" in line and parts and parts[0].endswith("_kernel"):
            rows.append({})
        elif rows and len(parts) >= 2 and parts[0] in EXTRA:
            rows[-1][EXTRA[parts[0]]] = float(parts[-1].replace(",", ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--driver", nargs=2, metavar=("M", "ROUTING"), help=argparse.SUPPRESS)
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--routing", default="ep_share", choices=("ep_share", "all_local"))
    ap.add_argument("--name", default="staged_kernels_ncu")
    args = ap.parse_args()
    if args.driver:
        drive(int(args.driver[0]), args.driver[1])
        return
    from bench.common import environment, write_results

    raw = profile(__file__, "staged", ",".join([METRICS, *EXTRA]), [str(args.m), args.routing])
    rows = summarize(str(args.m), args.routing, raw)
    for row, extra in zip(rows, extra_values(raw), strict=True):
        row.update(extra)
        print(row, flush=True)
    write_results(args.name, rows, ["M", "variant", "kernel", "threads", *COLUMNS.values(), *EXTRA.values(), "top_stalls"],
                  environment() | {"tool": NCU_TOOL}, args.out,
                  notes="variant: the routing. tensor_pipe_pct: tensor pipe active against its peak; eligible_warps: per "
                        "scheduler and cycle. " + NCU_NOTES)


if __name__ == "__main__":
    main()
