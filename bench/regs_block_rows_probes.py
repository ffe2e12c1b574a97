"""Probes around the register-dequant kernels' 64-row blocks (MXFP4, Kimi K3 rank: EP8, 112 of 896 experts, top-16),
none of which the library took: L2 in 128-row blocks fed by L1 in 64-row halves of the same rows (each 128-row
block's expert repeated for its two halves), and L1's other load order and weight rings uncapped.

Each variant runs L1 and L2 alone on the same routing (bench/regs_block_rows.py's timing: 6 calls back to back
between CUDA events, median of 3 rounds); bitwise: L2's FP32 pair rows equal to the first variant's. An environment
setting applies to both kernels of its variant (L2 with the "early" order is slower, which is why L1's time is the
figure there).

    PYTHONPATH=. python3 bench/regs_block_rows_probes.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import kimi_rank_block  # noqa: E402
from bench.common import env_applied, environment, write_results  # noqa: E402
from bench.prefill_regs import routing  # noqa: E402
from bench.regs_block_rows import compiled_registers, per_call_us  # noqa: E402
from latent_moe_fusion.ops.gluon_kernels import (  # noqa: E402
    LOAD_ORDER_ENV,
    MAXNREG_ENV,
    launch_routed_l1,
    launch_routed_l2,
)
from latent_moe_fusion.ops.triton_kernels.moe_align import group_by_expert  # noqa: E402

CASES = (("ep_share", 4096), ("ep_share", 16384), ("all_local", 4096))
# name: (L2 block rows, L1 ring, L2 ring, environment); L1 always runs 64-row blocks
VARIANTS = {
    "64/64": (64, None, None, {}),
    "64/128 l2 tma none": (128, None, "tma", {MAXNREG_ENV: "auto,none"}),
    "64/128 l2 cp4 none": (128, None, "cp4", {MAXNREG_ENV: "auto,none"}),
    "64/64 l1 early": (64, None, None, {LOAD_ORDER_ENV: "early"}),
    "64/64 l1 cp4 none": (64, "cp4", None, {MAXNREG_ENV: "none,auto"}),
    "64/64 l1 loads none": (64, "loads", None, {MAXNREG_ENV: "none,auto"}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    experts, inter, latent = block.num_local_experts, cfg.moe_intermediate_size, cfg.latent_size
    rows = []
    for kind, m in CASES:
        ids, _, z = routing(block, m, kind)
        local = ids.view(-1) >= 0
        groupings = {bm: group_by_expert(ids, experts, bm) for bm in (64, 128)}
        first = None
        for name, (l2_rows, ring1, ring2, env) in VARIANTS.items():
            g = groupings[l2_rows]
            halves = l2_rows // 64  # L1's 64-row blocks per L2 block, over the same rows
            l1_experts = g.block_expert.repeat_interleave(halves).contiguous() if halves > 1 else g.block_expert
            act = torch.full((g.nb_max * l2_rows, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            pairs = torch.full((ids.numel(), latent), float("nan"), dtype=torch.float32, device="cuda")

            def l1(g=g, act=act, l1_experts=l1_experts, halves=halves, ring1=ring1) -> None:
                launch_routed_l1(z, block.w13, block.w13_scale, g.sorted_pairs, l1_experts, act, g.nb_max * halves, 64,
                                 cfg.top_k, cfg.situ_beta, cfg.situ_linear_beta, ring=ring1)

            def l2(g=g, act=act, pairs=pairs, l2_rows=l2_rows, ring2=ring2) -> None:
                launch_routed_l2(act, block.w2, block.w2_scale, g.sorted_pairs, g.block_expert, pairs, g.nb_max,
                                 l2_rows, ring=ring2)

            with env_applied(env):
                l1()
                l2()
                out = pairs[local].clone()
                first = out if first is None else first
                rows.append({"routing": kind, "M": m, "variant": name, "l1_us": per_call_us(l1),
                             "l2_us": per_call_us(l2), "bitwise": bool(torch.equal(out, first)),
                             "finite": bool(torch.isfinite(out).all())})
            print(rows[-1], flush=True)
        del groupings, act, pairs, first, out
        torch.cuda.empty_cache()
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584",
        "timing": "L1 and L2 alone, 6 calls back to back between CUDA events, median of 3 rounds",
        "variant": "L1 block rows / L2 block rows, then what differs from the library's 64-row defaults (TMA rings, "
                   "no register cap, auto load order)",
    }
    json_path, _ = write_results("regs_block_rows_probes", rows, ["routing", "M", "variant", "l1_us", "l2_us",
                                                                  "bitwise", "finite"], meta, args.out)
    saved = json.loads(json_path.read_text())
    json_path.write_text(json.dumps(saved | {"registers": compiled_registers()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
