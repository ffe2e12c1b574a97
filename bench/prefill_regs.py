"""The routed op beyond decode (MXFP4, Kimi K3 rank: EP8, 112 of 896 experts, top-16): the Triton prefill tiles
(LMF_PREFILL_REGS=0) against the register-dequant kernels in 32-row blocks (the default up to
producer_config.PREFILL_REGS_MAX_ROWS pairs per local expert; LMF_PREFILL_REGS=32 forces them beyond).

Each variant runs `run_experts` (grouping, L1, L2, combine + RMSNorm) on the same routing (the block's router on
random tokens), 4 calls back to back between CUDA events, in 5 alternating rounds, median per call. Floor: the
routed experts' FLOPs (2 x 3 x I x L per valid pair) over the measured BF16 matmul rate. Error: relative L2
against the Triton tiles' output (both FP32 sums rounded once; not bitwise).

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
    env_applied,
    environment,
    measure_ceilings,
    rel_l2,
    time_back_to_back_interleaved_ms,
    write_results,
)
from latent_moe_fusion.ops.triton_kernels.expert_schedule import run_experts  # noqa: E402
from latent_moe_fusion.ops.triton_kernels.producer_config import PREFILL_REGS_ENV, pick_config  # noqa: E402

SIZES = (192, 256, 512, 1024, 2048, 4096, 8192, 16384)
SETTINGS = {"triton tiles": "0", "default": "", "regs 32 forced": "32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(SIZES))
    args = ap.parse_args()
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    rows = []
    for m in args.m:
        x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        ids, weights, z = torch.ops.lmf.route_and_project(
            x, block.gate_weight, block.correction_bias, block.w_down, "bf16", cfg.top_k, 1e-20,
            cfg.routed_scaling_factor, block.first_expert, block.num_local_experts)
        routed = (z, ids, weights, block.w13, block.w2, block.w13_scale, block.w2_scale, "mxfp4", cfg.situ_beta,
                  cfg.situ_linear_beta)
        settings = dict(SETTINGS)
        block_rows = {}
        for name, value in settings.items():
            with env_applied({PREFILL_REGS_ENV: value}):
                block_rows[name] = pick_config(m * cfg.top_k, "mxfp4", torch.bfloat16, block.num_local_experts).bm
        if block_rows["default"] == 32:
            del settings["regs 32 forced"]  # the default already
        fns = {}
        for name, value in settings.items():
            def call(value: str = value) -> torch.Tensor:
                with env_applied({PREFILL_REGS_ENV: value}):
                    return run_experts(*routed, rms_weight=block.norm_weight, eps=cfg.rms_norm_eps)
            fns[name] = call
        outs = {name: fn() for name, fn in fns.items()}
        times = time_back_to_back_interleaved_ms(fns)
        valid = int((ids >= 0).sum())
        floor_us = 2 * 3 * cfg.moe_intermediate_size * cfg.latent_size * valid / ceilings["bf16_flop_per_s"] * 1e6
        for name in fns:
            us = times[name] * 1e3
            rows.append({"M": m, "setting": name, f"{PREFILL_REGS_ENV}": settings[name] or "unset",
                         "block_rows": block_rows[name],
                         "us": us, "vs_triton_tiles": times["triton tiles"] / times[name], "floor_us": floor_us,
                         "x_floor": us / floor_us, "rel_l2_vs_triton_tiles": rel_l2(outs[name], outs["triton tiles"]),
                         "finite": bool(torch.isfinite(outs[name]).all())})
            print(rows[-1], flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584; routed op with RMSNorm",
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": "4 calls back to back between CUDA events, 5 alternating rounds, median per call",
        "floor": "routed FLOPs (2 x 3 x I x L per valid pair) / measured BF16 matmul rate",
        "block_rows": "rows per expert block: 64 / 128 for the Triton tiles (up to / beyond 4096 pairs), 16 / 32 "
                      "for the register-dequant kernels",
    }
    write_results("prefill_regs", rows, ["M", "setting", PREFILL_REGS_ENV, "block_rows", "us", "vs_triton_tiles",
                                         "floor_us", "x_floor", "rel_l2_vs_triton_tiles", "finite"], meta, args.out)


if __name__ == "__main__":
    main()
