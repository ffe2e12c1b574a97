"""Prefill routed experts: the MXFP4 grouped GEMMs' tile configurations, and the one-program against the
spread token grouping, at the block's M = 4096 routing.

One rank of Kimi K3 at EP8 as bench/block.py sees it: 4096 tokens, top-16 of 896 experts, the ids of
this rank's 112 experts kept (~8.2k pairs, ~73 rows per expert), MXFP4 weights. The routed op alone
(grouping, L1, L2, combine; no shared expert) is timed with CUDA events per candidate config (median of
`--iters` calls after warm-up); each candidate's output is checked against the picked config's. Floor:
the routed FLOPs over the measured BF16 rate (the op is compute-bound here; its weights are 2 GB).

    PYTHONPATH=. python3 bench/prefill_tiles.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, time_ms, write_results  # noqa: E402
from bench.producer import BETA, DT, INTER, LATENT, LIN_BETA, LOCAL_EXPERTS, make_weights  # noqa: E402
from latent_moe_fusion.ops.routed.expert_schedule import run_experts  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import GemmTiles, ProducerConfig, pick_config  # noqa: E402
from latent_moe_fusion.ops.routed.triton import moe_align  # noqa: E402
from latent_moe_fusion.ops.routed.triton.weight_tiles import DEQUANT_ASM_PAIRS, DEQUANT_DOT_SCALED, DEQUANT_LUT  # noqa: E402

GLOBAL_EXPERTS, TOP_K = 896, 16
COLUMNS = ["candidate", "bm", "l1", "l2", "dequant", "us", "x_floor", "rel_l2_vs_picked", "error"]


def block_routing(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-16 of 896 random scores per token, renormalised; ids outside this rank's 112 experts -> -1."""
    scores = torch.rand(m, GLOBAL_EXPERTS, generator=gen)
    top_s, top_i = scores.topk(TOP_K, dim=1, sorted=False)
    ids = torch.where(top_i < LOCAL_EXPERTS, top_i, -1).to(torch.int32)
    return ids.cuda(), (top_s / top_s.sum(1, keepdim=True)).cuda()


def candidates(picked: ProducerConfig) -> dict[str, ProducerConfig]:
    def both(**kw) -> ProducerConfig:
        return replace(picked, l1=replace(picked.l1, **kw), l2=replace(picked.l2, **kw))

    return {
        "picked": picked,
        "bm64": replace(picked, bm=64),
        "bn256": both(bn=256),
        "bk128_s2": both(bk=128, num_stages=2),
        "stages4": both(num_stages=4),
        "stages2": both(num_stages=2),
        "warps4": both(num_warps=4),
        "tma": both(tma=True),
        "asm_pairs": replace(picked, dequant=DEQUANT_ASM_PAIRS),
        "lut": replace(picked, dequant=DEQUANT_LUT),  # named explicitly: on sm_90 the picked one, so a repeat
        "dot_scaled": replace(picked, dequant=DEQUANT_DOT_SCALED),
        "l1_bn64": replace(picked, l1=replace(picked.l1, bn=64)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", nargs="*", help="candidate names to time (default: all; a name of none: grouping only)")
    args = ap.parse_args()
    ceilings = measure_ceilings()
    gen = torch.Generator().manual_seed(5)
    wt = make_weights("mxfp4", gen)
    z = torch.randn(args.m, LATENT, generator=gen).to(DT).cuda()
    ids, w = block_routing(args.m, gen)
    pairs = int((ids >= 0).sum())
    flops = pairs * 2 * (2 * INTER * LATENT + LATENT * INTER)
    floor = flops / ceilings["bf16_flop_per_s"] * 1e6
    routed = (z, ids, w, wt["w13"], wt["w2"], wt["w13_scale"], wt["w2_scale"], "mxfp4", BETA, LIN_BETA)
    picked = pick_config(ids.numel(), "mxfp4", DT, LOCAL_EXPERTS)
    ref = run_experts(*routed, config=picked)
    meta = environment() | {
        "config": f"routed experts alone, M = {args.m}, top-{TOP_K} of {GLOBAL_EXPERTS}, {LOCAL_EXPERTS} local MXFP4 "
                  f"experts, {pairs} pairs, L = {LATENT}, I = {INTER}",
        "floor_us": floor,
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": f"CUDA events, median of {args.iters} calls after 3 warm-up calls (grouping: CUDA graph replay of "
                  "one call, median of 20)",
    }
    rows = []
    grouping = {}
    for spread in (False, True):
        # GPU time (a CUDA graph of one call): at prefill the host launches ahead of the GPU
        grouping[spread] = time_graph_ms(
            lambda i, s=spread: moe_align.group_by_expert(ids, LOCAL_EXPERTS, picked.bm, spread=s), 1) * 1e3
    rows.append({"candidate": "grouping one program", "us": grouping[False]})
    rows.append({"candidate": "grouping spread", "us": grouping[True]})
    print(grouping, flush=True)
    for name, cfg in candidates(picked).items():
        if args.only and name not in args.only:
            continue
        row = {"candidate": name, "bm": cfg.bm, "l1": _tiles(cfg.l1), "l2": _tiles(cfg.l2), "dequant": cfg.dequant}
        try:
            out = run_experts(*routed, config=cfg)
            row["rel_l2_vs_picked"] = rel_l2(out, ref)
            row["us"] = time_ms(lambda c=cfg: run_experts(*routed, config=c), warmup=3, iters=args.iters) * 1e3
            row["x_floor"] = row["us"] / floor
        except Exception as exc:  # a candidate the kernels refuse or cannot compile: say so, go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(row, flush=True)
        write_results("prefill_tiles", rows, COLUMNS, meta, args.out)  # after each: a cut-off run keeps what it has
    write_results("prefill_tiles", rows, COLUMNS, meta, args.out)


def _tiles(t: GemmTiles) -> str:
    return f"{t.bn}x{t.bk} w{t.num_warps} s{t.num_stages}{' tma' if t.tma else ''}"


if __name__ == "__main__":
    main()
