"""The routed op beyond decode (MXFP4, Kimi K3 rank: EP8, 112 of 896 experts, top-16), by the prefill_regs tuning
override: the Triton prefill tiles (0), the register-dequant kernels in 32- and 64-row blocks (32 / 64), the staged
kernels in 128-row blocks (128), the default (32-, 64- then 128-row blocks by the pairs per local
expert counted as if every pair were local: producer_config.prefill_regs_block_m) and "gpu choice"
("choice", the default before the staged kernels: 32- and 64-row blocks up to PREFILL_REGS_MAX_ROWS,
beyond that a choice on the GPU between the 64-row blocks and the Triton tiles by the local experts' mean rows,
moe_align_choice.py; both families launch).

Routings: "ep_share" (the block's router on random tokens, the other ranks' experts -1; rows_per_hit_expert says how
many rows each local expert holds) and "all_local" (every token's 16 experts among the rank's 112: M x 16 / 112 rows
each).
Each variant runs `run_experts` (grouping, L1, L2, combine + RMSNorm) on the same routing, 4 calls back to back
between CUDA events, in 5 alternating rounds, median per call. Floor: the routed experts' FLOPs (2 x 3 x I x L per
valid pair) over the measured BF16 matmul rate. Error: relative L2 against the Triton tiles' output (both FP32 sums
rounded once; not bitwise). Host time: one call's, from an idle GPU (outside CUDA graphs prefill pays it).
"picked": what the default and "gpu choice" ran (host: regs / host: triton tiles, or gpu: ... where the GPU chose).

    PYTHONPATH=. python3 bench/prefill_regs.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import kimi_rank_block  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    host_us,
    measure_ceilings,
    rel_l2,
    time_back_to_back_interleaved_ms,
    write_results,
)
from bench.kernel_breakdown import breakdown_markdown, kernel_times_us  # noqa: E402
from latent_moe_fusion import KimiK3MoEBlock, tuning  # noqa: E402
from latent_moe_fusion.ops.routed.expert_schedule import planned_grouping, run_experts  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import PREFILL_REGS_OVERRIDE, pick_config  # noqa: E402
from latent_moe_fusion.ops.routed.triton.moe_align_choice import GroupingChoice  # noqa: E402

SIZES = (192, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
ALL_LOCAL_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
# name: the prefill_regs override ("": None, the measured default)
SETTINGS = {"triton tiles": "0", "default": "", "gpu choice": "choice", "regs 32 forced": "32", "regs 64 forced": "64",
            "staged 128 forced": "128"}
# Per-kernel breakdowns: the default's staged kernels on an EP share and all local, and where "gpu choice" has the GPU
# choose (dead programs of the unpicked family).
KERNEL_CASES = ("ep_share:4096", "ep_share:16384", "all_local:16384", "all_local:32768")


def routing(block: KimiK3MoEBlock, m: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, weights, z) of m random tokens for one rank (see the module docstring for the kinds)."""
    cfg = block.cfg
    x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids, weights, z = torch.ops.lmf.route_and_project(
        x, block.gate_weight, block.correction_bias, block.w_down, "bf16", cfg.top_k, 1e-20,
        cfg.routed_scaling_factor, block.first_expert, block.num_local_experts)
    if kind == "all_local":
        ids = torch.rand(m, block.num_local_experts, device="cuda").argsort(1)[:, :cfg.top_k].to(torch.int32)
    return ids, weights, z


def picked(routed: tuple, num_pairs: int, num_experts: int, setting: str = "") -> str:
    """What a setting (default: unset) runs for these routed arguments."""
    with tuning.overrides(prefill_regs=setting or None):
        cfg = pick_config(num_pairs, "mxfp4", torch.bfloat16, num_experts)
        if not cfg.device_choice_bm:
            return "host: regs" if cfg.routed_regs else "host: triton tiles"
        z, ids, _, w13, w2, w13_scale, w2_scale = routed[:7]
        choice = planned_grouping(z, ids, w13, w2, "mxfp4", w13_scale, w2_scale)
        if not isinstance(choice, GroupingChoice):
            return "host: triton tiles (regs cannot take the call)"
        return "gpu: regs" if int(choice.picked_small.item()) else "gpu: triton tiles"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(SIZES), help="token counts of the ep_share routing")
    ap.add_argument("--all-local-m", type=int, nargs="*", default=list(ALL_LOCAL_SIZES),
                    help="token counts of the all_local routing")
    ap.add_argument("--kernels", nargs="*", default=list(KERNEL_CASES), metavar="ROUTING:M",
                    help="cases whose per-kernel times (profiler) go to prefill_regs_kernels.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    rows = []
    kernels: dict[str, list[tuple[str, float]]] = {}
    cases = [("ep_share", m) for m in args.m] + [("all_local", m) for m in args.all_local_m]
    for kind, m in cases:
        ids, weights, z = routing(block, m, kind)
        routed = (z, ids, weights, block.w13, block.w2, block.w13_scale, block.w2_scale, "mxfp4", cfg.situ_beta,
                  cfg.situ_linear_beta)
        settings = dict(SETTINGS)
        block_rows = {}
        for name, value in settings.items():
            with tuning.overrides(prefill_regs=value or None):
                block_rows[name] = pick_config(m * cfg.top_k, "mxfp4", torch.bfloat16, block.num_local_experts).bm
        default_runs = picked(routed, m * cfg.top_k, block.num_local_experts)
        choice_runs = picked(routed, m * cfg.top_k, block.num_local_experts, "choice")
        if default_runs == "host: regs":  # the forced setting of the default's blocks runs the default already
            settings = {n: v for n, v in settings.items() if n == "default" or v != str(block_rows["default"])}
        fns = {}
        for name, value in settings.items():
            def call(value: str = value) -> torch.Tensor:
                with tuning.overrides(prefill_regs=value or None):
                    return run_experts(*routed, rms_weight=block.norm_weight, eps=cfg.rms_norm_eps)
            fns[name] = call
        outs = {name: fn() for name, fn in fns.items()}
        times = time_back_to_back_interleaved_ms(fns)
        host = {name: host_us(fn, calls=20)[0] for name, fn in fns.items()}
        valid = int((ids >= 0).sum())
        hit = int(torch.unique(ids[ids >= 0]).numel())
        floor_us = 2 * 3 * cfg.moe_intermediate_size * cfg.latent_size * valid / ceilings["bf16_flop_per_s"] * 1e6
        best_forced = min(times[n] for n in fns if n not in ("default", "gpu choice"))
        if f"{kind}:{m}" in args.kernels:
            for name, fn in fns.items():
                kernels[f"{kind}, M = {m}, {name}"] = kernel_times_us(fn, top=10)
        for name in fns:
            us = times[name] * 1e3
            rows.append({"routing": kind, "M": m, "setting": name, PREFILL_REGS_OVERRIDE: settings[name] or "None",
                         "picked": {"default": default_runs, "gpu choice": choice_runs}.get(name, ""),
                         "block_rows": block_rows[name],
                         "rows_per_hit_expert": valid / max(hit, 1), "us": us, "host_us": host[name],
                         "vs_triton_tiles": times["triton tiles"] / times[name],
                         "vs_best_forced": best_forced / times[name], "floor_us": floor_us,
                         "x_floor": us / floor_us, "rel_l2_vs_triton_tiles": rel_l2(outs[name], outs["triton tiles"]),
                         "finite": bool(torch.isfinite(outs[name]).all())})
            print(rows[-1], flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584; routed op with RMSNorm",
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": "4 calls back to back between CUDA events, 5 alternating rounds, median per call",
        "floor": "routed FLOPs (2 x 3 x I x L per valid pair) / measured BF16 matmul rate",
        "block_rows": "rows per expert block: 64 / 128 for the Triton tiles (up to / beyond 4096 pairs), 16 / 32 / 64 "
                      "for the register-dequant kernels, 128 for the staged kernels; gpu choice beyond the host bound: "
                      "the Triton tiles' 128 (the GPU may run the 64-row blocks instead, see picked)",
        "vs_best_forced": "the fastest forced setting over this one: the default's cost of its choice",
        "host_us": "median host time of one call from an idle GPU to its return (bench.common.host_us, 20 calls): "
                   "where it nears us, the back-to-back figure is partly the host's",
    }
    columns = ["routing", "M", "setting", PREFILL_REGS_OVERRIDE, "picked", "block_rows", "rows_per_hit_expert", "us",
               "host_us", "vs_triton_tiles", "vs_best_forced", "floor_us", "x_floor", "rel_l2_vs_triton_tiles", "finite"]
    write_results("prefill_regs", rows, columns, meta, args.out)
    if kernels:
        (Path(args.out) / "prefill_regs_kernels.md").write_text(
            f"# prefill_regs: CUDA kernel time per kernel (profiler, 5 calls)\n\n{meta['device']}, torch {meta['torch']}, "
            f"triton {meta['triton']}; {meta['config']}\n\n" + breakdown_markdown(kernels))


if __name__ == "__main__":
    main()
