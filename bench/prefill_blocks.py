"""The routed op at prefill in 64-row blocks (the register-dequant kernels) against 128-row blocks (the staged
kernels, ops/routed/gluon/routed_staged.py), on the Kimi K3 rank (EP8: 112 of 896 experts MXFP4, top-16).

Per case: the whole op (grouping, L1, L2, combine + RMSNorm), L1 alone and L2 alone on each variant's own grouping,
each 4 calls back to back between CUDA events in 5 alternating rounds (median per call). Floors: the routed FLOPs
(2 x 3 x I x L per valid pair; L1 two thirds of them) over the measured BF16 matmul rate. bitwise_vs_64: the op's
output equal to the 64-row blocks' bit for bit; rel_l2_vs_64 otherwise says how far.

    PYTHONPATH=. python3 bench/prefill_blocks.py --out bench/results [--name prefill_blocks]
    PYTHONPATH=. python3 bench/prefill_blocks.py --staged-max-registers none --name prefill_blocks_one_cta
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import kimi_rank_block  # noqa: E402
from bench.common import (  # noqa: E402
    env_applied,
    environment,
    measure_ceilings,
    rel_l2,
    time_back_to_back_interleaved_ms,
    write_results,
)
from bench.prefill_regs import routing  # noqa: E402
from latent_moe_fusion.ops.routed import gluon as gk  # noqa: E402
from latent_moe_fusion.ops.routed.expert_schedule import run_experts  # noqa: E402
from latent_moe_fusion.ops.routed.gluon import launch_routed_l1, launch_routed_l2  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import PREFILL_REGS_ENV  # noqa: E402
from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert  # noqa: E402

CASES = [("ep_share", m) for m in (1024, 2048, 4096, 8192, 16384)] + [("all_local", m) for m in (1024, 4096)]
VARIANTS = {"regs 64": 64, "staged 128": 128}  # name: rows per block (LMF_PREFILL_REGS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", default="prefill_blocks")
    ap.add_argument("--staged-max-registers", default="auto",
                    help="the staged kernels' register cap: auto (the library's), none, or a count "
                         "(none: one CTA per SM, prefill_blocks_one_cta)")
    args = ap.parse_args()
    if args.staged_max_registers != "auto":
        gk.STAGED_MAX_REGISTERS = None if args.staged_max_registers == "none" else int(args.staged_max_registers)
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    experts, inter, latent = block.num_local_experts, cfg.moe_intermediate_size, cfg.latent_size
    variants = VARIANTS
    rows = []
    for kind, m in CASES:
        ids, weights, z = routing(block, m, kind)
        routed = (z, ids, weights, block.w13, block.w2, block.w13_scale, block.w2_scale, "mxfp4", cfg.situ_beta,
                  cfg.situ_linear_beta)
        valid = int((ids >= 0).sum())
        hit = int(torch.unique(ids[ids >= 0]).numel())
        floor_us = 2 * 3 * inter * latent * valid / ceilings["bf16_flop_per_s"] * 1e6
        ops, l1s, l2s = {}, {}, {}
        for name, bm in variants.items():
            def op(bm: int = bm) -> torch.Tensor:
                with env_applied({PREFILL_REGS_ENV: str(bm)}):
                    return run_experts(*routed, rms_weight=block.norm_weight, eps=cfg.rms_norm_eps)
            grouping = group_by_expert(ids, experts, bm)
            act = torch.full((grouping.nb_max * bm, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            pairs = torch.full((ids.numel(), latent), float("nan"), dtype=torch.float32, device="cuda")

            def l1(g=grouping, act=act, bm=bm) -> None:
                launch_routed_l1(z, block.w13, block.w13_scale, g.sorted_pairs, g.block_expert, act, g.nb_max, bm,
                                 cfg.top_k, cfg.situ_beta, cfg.situ_linear_beta)

            def l2(g=grouping, act=act, pairs=pairs, bm=bm) -> None:
                launch_routed_l2(act, block.w2, block.w2_scale, g.sorted_pairs, g.block_expert, pairs, g.nb_max, bm)

            ops[name], l1s[name], l2s[name] = op, l1, l2
        outs = {name: fn().clone() for name, fn in ops.items()}
        t_op, t_l1, t_l2 = (time_back_to_back_interleaved_ms(fns) for fns in (ops, l1s, l2s))
        first = next(iter(variants))
        for name in variants:
            rows.append({
                "routing": kind, "M": m, "variant": name, "rows_per_hit_expert": valid / max(hit, 1),
                "op_us": t_op[name] * 1e3, "l1_us": t_l1[name] * 1e3, "l2_us": t_l2[name] * 1e3,
                "op_vs_64": t_op[first] / t_op[name], "l1_vs_64": t_l1[first] / t_l1[name],
                "l2_vs_64": t_l2[first] / t_l2[name], "floor_us": floor_us, "op_x_floor": t_op[name] * 1e3 / floor_us,
                "l1_x_floor": t_l1[name] * 1e3 / (floor_us * 2 / 3), "l2_x_floor": t_l2[name] * 1e3 / (floor_us / 3),
                "bitwise_vs_64": bool(torch.equal(outs[name], outs[first])),
                "rel_l2_vs_64": rel_l2(outs[name], outs[first]), "finite": bool(torch.isfinite(outs[name]).all()),
            })
            print(rows[-1], flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584; routed op with RMSNorm",
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": "4 calls back to back between CUDA events, 5 alternating rounds, median per call; L1 and L2 alone "
                  "on the variant's own grouping",
        "floor": "routed FLOPs (2 x 3 x I x L per valid pair; L1 2/3, L2 1/3) / measured BF16 matmul rate",
        "staged_max_registers": gk.STAGED_MAX_REGISTERS,
    }
    columns = ["routing", "M", "variant", "rows_per_hit_expert", "op_us", "l1_us", "l2_us", "op_vs_64", "l1_vs_64",
               "l2_vs_64", "floor_us", "op_x_floor", "l1_x_floor", "l2_x_floor", "bitwise_vs_64", "rel_l2_vs_64",
               "finite"]
    write_results(args.name, rows, columns, meta, args.out)


if __name__ == "__main__":
    main()
