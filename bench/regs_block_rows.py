"""The register-dequant kernels' L1 and L2 beyond decode in 32- and 64-row blocks (MXFP4, Kimi K3 rank: EP8, 112 of
896 experts, top-16), with the weight rings and register caps that 64-row blocks change.

A block dequantises its expert's weight tile once for all its rows, so 64-row blocks halve the dequantisation per
FLOP where the experts hold many rows; their accumulators need more registers (L1 252 uncapped, L2 128 on the TMA
ring), so L2's cap of 80 for 32-row blocks spills. Each variant runs L1 and L2 alone on the same grouping (every
local pair of the routing in blocks of the variant's rows), each timed over 6 calls back to back between CUDA
events, median of 3 rounds. Output: the FP32 pair rows L2 writes, compared with the first variant's bit for bit.
Floor: the routed experts' FLOPs (2 x 3 x I x L per valid pair) over the measured BF16 matmul rate. Registers and
spills: the compiled kernels' (Triton's cache). --probes times variants around the 64-row default that the library
did not take (L2 in 128-row blocks over L1's 64-row halves, L1's other load order and rings uncapped) into
regs_block_rows_probes.{json,md}.

    PYTHONPATH=. python3 bench/regs_block_rows.py --out bench/results [--probes]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import kimi_rank_block  # noqa: E402
from bench.common import (  # noqa: E402
    env_applied,
    environment,
    markdown_table,
    measure_ceilings,
    rel_l2,
    write_results,
)
from bench.prefill_regs import routing  # noqa: E402
from latent_moe_fusion.ops.routed.gluon import (  # noqa: E402
    LOAD_ORDER_ENV,
    MAXNREG_ENV,
    launch_routed_l1,
    launch_routed_l2,
)
from latent_moe_fusion.ops.routed.gluon.routed_gemm import l1_regs_kernel, l2_regs_kernel  # noqa: E402
from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert  # noqa: E402

# name: (L1 block rows, L2 block rows, L1 ring, L2 ring, environment); None rings and no environment: the library's
# choice for those rows. L2 blocks of twice L1's rows take L1's blocks as halves of the same rows.
VARIANTS = {
    "32 rows": (32, 32, None, None, {}),
    "64 rows, L2 cp4 capped at 80": (64, 64, None, "cp4", {MAXNREG_ENV: "auto,80"}),
    "64 rows, L2 cp4 capped at 128": (64, 64, None, "cp4", {MAXNREG_ENV: "auto,128"}),
    "64 rows, L2 cp4 uncapped": (64, 64, None, "cp4", {MAXNREG_ENV: "auto,none"}),
    "64 rows": (64, 64, None, None, {}),
    "64 rows, L1 cp4 capped at 128": (64, 64, "cp4", None, {MAXNREG_ENV: "128,auto"}),
}
CASES = [("ep_share", m) for m in (1024, 2048, 4096, 8192, 16384)] + [("all_local", m) for m in (1024, 2048, 4096)]
# --probes: around the 64-row default, none taken by the library (an environment setting applies to both kernels of
# its variant: L2 with the "early" order is slower, so L1's time is the figure there)
PROBE_VARIANTS = {
    "64/64": (64, 64, None, None, {}),
    "64/128 l2 tma none": (64, 128, None, "tma", {MAXNREG_ENV: "auto,none"}),
    "64/128 l2 cp4 none": (64, 128, None, "cp4", {MAXNREG_ENV: "auto,none"}),
    "64/64 l1 early": (64, 64, None, None, {LOAD_ORDER_ENV: "early"}),
    "64/64 l1 cp4 none": (64, 64, "cp4", None, {MAXNREG_ENV: "none,auto"}),
    "64/64 l1 loads none": (64, 64, "loads", None, {MAXNREG_ENV: "none,auto"}),
}
PROBE_CASES = [("ep_share", 4096), ("ep_share", 16384), ("all_local", 4096)]


def per_call_us(fn: Callable[[], None], calls: int = 6, rounds: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def _launch_settings(key: str) -> dict:
    """Block rows, ring and register cap of a compiled kernel, from its specialisation key: the kernels' last eight
    constexprs are BM, BK, SPLIT, num_warps, SIGNAL / PDL, RING, STAGES, ORDER; maxnreg is a launch option."""
    constexprs = re.findall(r"\('constexpr', ([^)]*)\)", key)[-8:]
    cap = re.search(r"'maxnreg': (\w+)", key)
    return {"block_rows": int(constexprs[0]), "ring": constexprs[5].strip("'") + (constexprs[6] if "cp" in
            constexprs[5] else ""), "maxnreg": cap.group(1) if cap else "?"}


def compiled_registers() -> list[dict]:
    """Registers and spills of every compiled L1 / L2, with its block rows, ring and register cap."""
    rows = []
    for kernel in (l1_regs_kernel, l2_regs_kernel):
        for cache in kernel.device_caches.values():
            for key, compiled in cache[0].items():
                rows.append({"kernel": compiled.name, **_launch_settings(str(key)), "registers": compiled.n_regs,
                             "spills": compiled.n_spills})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--probes", action="store_true", help="the probes around the 64-row default (regs_block_rows_probes)")
    args = ap.parse_args()
    variants, cases = (PROBE_VARIANTS, PROBE_CASES) if args.probes else (VARIANTS, CASES)
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    experts, inter, latent = block.num_local_experts, cfg.moe_intermediate_size, cfg.latent_size
    rows = []
    for kind, m in cases:
        ids, _, z = routing(block, m, kind)
        local = ids.view(-1) >= 0
        valid = int(local.sum())
        rows_per_hit_expert = valid / max(int(torch.unique(ids[ids >= 0]).numel()), 1)
        floor_us = 2 * 3 * inter * latent * valid / ceilings["bf16_flop_per_s"] * 1e6
        groupings = {bm: group_by_expert(ids, experts, bm) for bm in {v[1] for v in variants.values()}}
        first = None
        for name, (l1_rows, l2_rows, ring1, ring2, env) in variants.items():
            g = groupings[l2_rows]
            halves = l2_rows // l1_rows  # L1's blocks per L2 block, over the same rows
            l1_experts = g.block_expert.repeat_interleave(halves).contiguous() if halves > 1 else g.block_expert
            act = torch.full((g.nb_max * l2_rows, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
            pairs = torch.full((ids.numel(), latent), float("nan"), dtype=torch.float32, device="cuda")

            def l1(g=g, act=act, l1_rows=l1_rows, l1_experts=l1_experts, halves=halves, ring1=ring1) -> None:
                launch_routed_l1(z, block.w13, block.w13_scale, g.sorted_pairs, l1_experts, act, g.nb_max * halves,
                                 l1_rows, cfg.top_k, cfg.situ_beta, cfg.situ_linear_beta, ring=ring1)

            def l2(g=g, act=act, pairs=pairs, l2_rows=l2_rows, ring2=ring2) -> None:
                launch_routed_l2(act, block.w2, block.w2_scale, g.sorted_pairs, g.block_expert, pairs, g.nb_max,
                                 l2_rows, ring=ring2)

            with env_applied(env):
                l1()
                l2()
                out = pairs[local].clone()
                first = out if first is None else first
                l1_us, l2_us = per_call_us(l1), per_call_us(l2)
            rows.append({"routing": kind, "M": m, "variant": name, "rows_per_hit_expert": rows_per_hit_expert,
                         "l1_us": l1_us, "l2_us": l2_us,
                         "l1_l2_us": l1_us + l2_us, "vs_first": None, "floor_us": floor_us,
                         "x_floor": (l1_us + l2_us) / floor_us, "finite": bool(torch.isfinite(out).all()),
                         "bitwise_first": bool(torch.equal(out, first)), "rel_l2_first": rel_l2(out, first)})
            print(rows[-1], flush=True)
        case_rows = rows[-len(variants):]
        for r in case_rows:  # the first variant: 32-row blocks (the library's 64-row default with --probes)
            r["vs_first"] = case_rows[0]["l1_l2_us"] / r["l1_l2_us"]
        del groupings, act, pairs, first, out
        torch.cuda.empty_cache()
    registers = compiled_registers()
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584",
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": "L1 and L2 alone, 6 calls back to back between CUDA events, median of 3 rounds",
        "rings": "library default unless named: 32 rows TMA (L1) and cp4 (L2 beyond 2048 pairs, TMA below); "
                 "64 rows TMA for both (routed.gluon.default_rings)",
        "caps": "library default unless named: 32 rows L1 uncapped on the TMA ring, L2 80; 64 rows uncapped",
        "variant": "--probes: L1 block rows / L2 block rows, then what differs from the 64-row default",
        "vs_first": "the case's first variant's L1 + L2 time over this one's",
        "bitwise_first": "L2's FP32 pair rows equal to the first variant's bit for bit",
    }
    columns = ["routing", "M", "variant", "rows_per_hit_expert", "l1_us", "l2_us", "l1_l2_us", "vs_first",
               "floor_us", "x_floor", "finite", "bitwise_first", "rel_l2_first"]
    reg_table = markdown_table(registers, ["kernel", "block_rows", "ring", "maxnreg", "registers", "spills"])
    name = "regs_block_rows_probes" if args.probes else "regs_block_rows"
    json_path, _ = write_results(name, rows, columns, meta, args.out,
                                 notes="## Compiled kernels\n\n" + reg_table)
    saved = json.loads(json_path.read_text())
    json_path.write_text(json.dumps(saved | {"registers": registers}, indent=2) + "\n")


if __name__ == "__main__":
    main()
