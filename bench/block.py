"""End-to-end Kimi K3 block on one H200: eager vs serving-style vs compiled vs compiled + fused.

`serving` is what Hopper serving runs today (bench/serving_baseline.py): the routed experts on triton_kernels' MXFP4
MoE as vLLM sets it up, the rest of the block compiled without the pass; it needs the triton_kernels source
(`--triton-kernels`, default .peer/python/triton_kernels) and is left out, with a message, without it.

One rank of Kimi K3 at TP8/EP8: 112 local MXFP4 experts of 896 (ids of other ranks' experts
become -1), top-16, shared expert 768 wide (TP8's shard), R = 1 (no cross-rank traffic: this
measures one rank's compute). Decode sizes run inside CUDA graphs with rotating inputs; prefill
(M = 4096 to 32768) runs without. The floor is the bytes the block must read once (router, down and up
projections, shared weights, the experts actually hit, activations) over the measured copy
bandwidth, or its FLOPs over the measured BF16 rate, whichever is larger; at decode it is the mean
over the rotating input sets the timing averages over (each routes to its own experts). The router
runs as serving engines run it (a BF16 GEMM with FP32 logits; `--router-gemm fp32` runs the HF reference's FP32 GEMM,
which the floor's byte count also covers only at BF16 weight size).

The pass rewrites the shared expert, the RMSNorm, the up-projection and the add, and the router's chain
after its GEMM (sigmoid, top-k, renormalisation, EP share: lmf::noaux_tc_route); the router GEMM, the
latent down-projection and the routed experts run the same kernels with or without it, but with the
pass the router GEMM and route run beside the down-projection on a second stream up to 64 tokens
(lmf::route_and_project), and up to 128 tokens go with the producer into lmf::route_and_produce, which
from 5 tokens on starts the shared expert first, beside them. The variants `compiled+fused-no-router`
(FusionConfig(fuse_routing=False): neither router rewrite), `compiled+fused-no-overlap`
(FusionConfig(overlap_router=False): the router chain fused, in a row with the down-projection) and
`compiled+fused-no-shared-first` (FusionConfig(shared_first=False): lmf::route_and_project, the shared
expert inside the producer) show each rewrite's share. `untouched_us` times router +
down-projection + routed experts alone (compiled, in a row, same timing method), `router_chain_us` the
compiled router chain alone and `down_projection_us` the compiled down-projection alone (the fused block
runs it on its own kernel, ops/routed/router_fused/down_projection.py); untouched_us - router_chain_us - down_projection_us
is then the part no kernel rewrite touches (router GEMM, routed experts), and compiled_us over it bounds
what a rewrite of the rest that keeps that part in a row can reach (`max_fused_vs_compiled`; the overlaps
can go beyond it).
`ceiling_fused_vs_compiled` goes further: the largest ratio over every speed of the routed experts (the
same kernels in both variants, from their floor to as measured), with the compiled baseline's router GEMM
and rewritten part (cuBLAS and Inductor kernels) as measured and the fused block no faster than the routed
experts plus the down- and up-projection floors (they run before and after the routed experts in any
schedule) nor than the whole block's floor (`ratio_ceiling`): no kernel or schedule can beat that ratio.

    PYTHONPATH=. python3 bench/block.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latent_moe_fusion as lmf  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    measure_ceilings,
    rel_l2,
    time_back_to_back_interleaved_ms,
    time_graphs_interleaved_ms,
    time_interleaved_ms,
    write_results,
)
from bench.kernel_breakdown import breakdown_markdown, kernel_times_us  # noqa: E402
from bench.peer_layout import DEFAULT_TRITON_KERNELS, HOW_TO_GET, use_triton_kernels  # noqa: E402
from bench.serving_baseline import serving_block  # noqa: E402
from latent_moe_fusion.fusion_pass import FusionConfig  # noqa: E402
from latent_moe_fusion.model.router import ROUTER_GEMMS, localize_ids, route, route_from_logits, router_logits  # noqa: E402

DECODE_M = (1, 8, 32, 128)
PREFILL_M = (4096, 8192, 16384, 32768)


def block_parts_bytes_and_flops(block: lmf.KimiK3MoEBlock, x: torch.Tensor) -> dict[str, tuple[float, float]]:
    """(bytes moved once, FLOPs) of the two parts of the block: "untouched" (router, the routed experts hit,
    reading x) and "rewritten" (what the pass replaces: latent down-projection, RMSNorm, up-projection, shared
    expert, add, writing out). Intermediates between them are not counted."""
    cfg = block.cfg
    m, h = x.shape
    ids, _ = route(x, block.gate_weight, block.correction_bias, cfg.top_k, cfg.routed_scaling_factor, block.router_gemm)
    ids = localize_ids(ids, block.first_expert, block.num_local_experts)
    hit = torch.unique(ids[ids >= 0]).numel()
    assignments = int((ids >= 0).sum())
    per_expert = sum(t[0].numel() * t.element_size() for t in (block.w13, block.w2))
    if block.w13_scale is not None:
        per_expert += sum(t[0].numel() for t in (block.w13_scale, block.w2_scale))

    def nbytes(names: tuple[str, ...]) -> int:
        return sum(p.numel() * p.element_size() for name, p in block.named_parameters() if name.startswith(names))

    act = x.numel() * x.element_size()
    lat, inter, i_s, e = cfg.latent_size, cfg.moe_intermediate_size, block.shared_w2.shape[1], cfg.num_experts
    # The latent down-projection counts as rewritten: inside lmf::route_and_project / route_and_produce the
    # fused block runs it on its own kernel (ops/routed/router_fused/down_projection.py), the compiled baseline on cuBLAS.
    untouched = (nbytes(("gate_weight", "correction_bias")) + hit * per_expert + act,
                 2 * m * h * e + 2 * assignments * 3 * inter * lat)
    rewritten = (nbytes(("w_down", "w_up", "norm_weight", "shared_")) + act, 2 * m * (2 * lat * h + 3 * h * i_s))
    known = {"gate_weight", "correction_bias", "w_down", "w13", "w2", "w13_scale", "w2_scale", "w_up", "norm_weight"}
    stray = [n for n, _ in block.named_parameters() if n not in known and not n.startswith("shared_")]
    assert not stray, f"parameters missing from the floor: {stray}"
    return {"untouched": tuple(map(float, untouched)), "rewritten": tuple(map(float, rewritten))}


def ratio_ceiling(routed_us: float, routed_floor_us: float, fixed_compiled_us: float, serial_floor_us: float,
                  block_floor_us: float) -> float:
    """The largest compiled / fused any kernels or schedule of the fused block could reach against this
    baseline, over every speed of the kernels both variants share.

    The routed experts (same kernels in both variants) may take anything from routed_floor_us to their measured
    routed_us = r; the compiled baseline then takes r + fixed_compiled_us (its router GEMM and rewritten part as
    measured). The fused block takes at least r + serial_floor_us (the down-projection before the routed experts
    and the up-projection after them, at their floors) and at least the whole block's floor. The ratio
    (r + fixed) / max(r + serial, block floor) is monotonic on either side of r = block floor - serial, so its
    largest value over the interval is at an end or at that point clamped into it."""
    def ratio(r: float) -> float:
        return (r + fixed_compiled_us) / max(r + serial_floor_us, block_floor_us)

    knee = min(max(block_floor_us - serial_floor_us, routed_floor_us), routed_us)
    return max(ratio(routed_floor_us), ratio(knee), ratio(routed_us))


def ratios_with_routed_as_measured(compiled_us: float, routed_us: float, router_gemm_us: float,
                                   rewritten_floor_us: float, serial_floor_us: float) -> tuple[float, float]:
    """What compiled / fused a rewrite can reach while the routed experts (both variants' kernels) stay as
    measured: (everything else run in a row at its floor, with the router GEMM as measured; everything but the
    down- and up-projection, themselves at their floors, hidden beside the routed experts)."""
    return (compiled_us / (routed_us + router_gemm_us + rewritten_floor_us),
            compiled_us / (routed_us + serial_floor_us))


def floor_us(nbytes: float, flops: float, ceilings: dict[str, float]) -> float:
    return max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flop_per_s"]) * 1e6


def router_floor_us(gate_bytes: float, m: int, hidden: int, num_experts: int, ceilings: dict[str, float]) -> float:
    """The router GEMM's floor: its weight and bias read once, or its FLOPs at the BF16 rate."""
    return floor_us(gate_bytes, 2 * m * hidden * num_experts, ceilings)


def routed_op_us(row: dict[str, float]) -> float:
    """The routed experts' time in a block row, as both variants run them (the same op and kernels): untouched
    (router GEMM + chain, down-projection, routed op, compiled in a row) less the parts timed alone."""
    return row["untouched_us"] - row["router_chain_us"] - row["down_projection_us"] - row["router_gemm_us"]


def compiled(block, fused: bool, config: FusionConfig | None = None):
    fpass = lmf.LatentMoEFusionPass(config) if fused else None
    options = {"post_grad_custom_pre_pass": fpass} if fused else {}
    return torch.compile(block, options=options, dynamic=False), fpass


def compile_afresh() -> None:
    """Compiler settings for benchmarks that compile the block per variant and size."""
    # Every (variant, size) pair is its own Dynamo compile of one forward: past the default limit of 8,
    # Dynamo silently runs the block eagerly, which would pass eager timings off as compiled ones.
    torch._dynamo.config.recompile_limit = 64
    # A cached graph skips the pass, and its report then says 0 blocks matched: compile afresh.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def kimi_rank_block(router_gemm: str) -> lmf.KimiK3MoEBlock:
    """One rank of Kimi K3 at TP8/EP8 on the GPU: MXFP4 experts 0-111 of 896, shared expert 768 wide."""
    cfg = lmf.KimiK3MoEConfig().replace(shared_intermediate_size=768)
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=0,
                              ep_size=8, ep_rank=0, router_gemm=router_gemm)


def decode_inputs(block: lmf.KimiK3MoEBlock, m: int, sets: int = 4) -> list[torch.Tensor]:
    """`sets` fresh token batches [m, H] on the GPU, rotated through by the decode timings (cold L2 between calls)."""
    return [torch.randn(m, block.cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]


def compiled_rank_block(router_gemm: str = "bf16"):
    """The decode benchmarks' common start: seeded, compiled afresh, one Kimi K3 rank block and its
    compiled forwards without and with the pass. Returns (block, compiled, compiled + fused, the pass)."""
    torch.manual_seed(0)
    compile_afresh()
    block = kimi_rank_block(router_gemm)
    base, _ = compiled(block, False)
    fused, fpass = compiled(block, True)
    return block, base, fused, fpass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(DECODE_M + PREFILL_M))
    ap.add_argument("--no-kernels", action="store_true", help="skip the per-kernel time breakdown")
    ap.add_argument("--name", default="block",
                    help="results name: NAME.{json,md,png} and NAME_kernels.md (a run of a few M under its own name)")
    ap.add_argument("--router-gemm", choices=ROUTER_GEMMS, default="bf16",
                    help="the block's router GEMM (default bf16 with FP32 logits, as serving engines run it)")
    ap.add_argument("--triton-kernels", default=str(DEFAULT_TRITON_KERNELS),
                    help="triton_kernels source for the serving-style baseline (bench/serving_baseline.py); "
                         "without it the 'serving' column is left out, with a message")
    args = ap.parse_args()
    torch.manual_seed(0)
    compile_afresh()
    ceilings = measure_ceilings()
    block = kimi_rank_block(args.router_gemm)
    cfg = block.cfg
    variants = {"eager": (block, None), "compiled": compiled(block, False), "compiled+fused": compiled(block, True),
                "compiled+fused-no-router": compiled(block, True, FusionConfig(fuse_routing=False)),
                "compiled+fused-no-overlap": compiled(block, True, FusionConfig(overlap_router=False)),
                "compiled+fused-no-shared-first": compiled(block, True, FusionConfig(shared_first=False))}
    # What Hopper serving runs today: the routed experts on triton_kernels as vLLM sets it up, the rest compiled
    # unfused (bench/serving_baseline.py)
    missing = use_triton_kernels(args.triton_kernels)
    if missing is None:
        variants["serving"] = (serving_block(block, triton_kernels=args.triton_kernels), None)
    else:
        print(f"no serving column: {missing}. {HOW_TO_GET}", flush=True)
    untouched = torch.compile(block.routed, dynamic=False)  # router + down-projection + routed op

    def router_chain(logits):  # what the router rewrite replaces, as the block computes it
        ids, weights = route_from_logits(logits, block.correction_bias, cfg.top_k, cfg.routed_scaling_factor)
        return localize_ids(ids, block.first_expert, block.num_local_experts), weights

    router_chain = torch.compile(router_chain, dynamic=False)
    down_projection = torch.compile(lambda x: F.linear(x, block.w_down), dynamic=False)  # as block.routed does it
    router_gemm = torch.compile(lambda x: router_logits(x, block.gate_weight, block.router_gemm), dynamic=False)
    rows = []
    kernels: dict[str, list[tuple[str, float]]] = {}
    for m in args.m:
        num_sets = 4 if m <= 128 else 2
        xs = [torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(num_sets)]
        # Decode times the mean over the rotating sets, and each set routes to its own experts: the floor
        # is the mean over the same sets (prefill times xs[0] only).
        timed_sets = xs if m <= 128 else xs[:1]
        per_set = [block_parts_bytes_and_flops(block, x) for x in timed_sets]
        parts = {part: tuple(sum(p[part][i] for p in per_set) / len(per_set) for i in range(2))
                 for part in ("untouched", "rewritten")}
        nbytes = sum(b for b, _ in parts.values())
        flops = sum(f for _, f in parts.values())
        block_floor_us = floor_us(nbytes, flops, ceilings)
        ref = block(xs[0])
        row = {"M": m, "floor_us": block_floor_us, "bytes_MB": nbytes / 1e6, "GFLOP": flops / 1e9}
        row |= {f"{part}_floor_us": floor_us(*parts[part], ceilings) for part in parts}
        for name, (fn, fpass) in variants.items():
            row[f"{name}_err"] = rel_l2(fn(xs[0]), ref)
            if fpass is not None:
                report = fpass.report
                beside = sum(1 for r in report.routings if r.beside)
                row[f"{name}_matched"] = f"{report.matched} block, {len(report.routings)} router, {beside} beside"
        timed = {name: fn for name, (fn, _) in variants.items()} | {"untouched": untouched}
        logits = [router_logits(x, block.gate_weight, block.router_gemm) for x in xs]
        if m <= 128:  # one graph per variant, replayed in alternating rounds: drift hits every variant alike
            medians = time_graphs_interleaved_ms({name: lambda i, fn=fn: fn(xs[i]) for name, fn in timed.items()}
                                                 | {"router_chain": lambda i: router_chain(logits[i]),
                                                    "down_projection": lambda i: down_projection(xs[i]),
                                                    "router_gemm": lambda i: router_gemm(xs[i])}, num_sets)
            row |= {f"{name}_us": ms * 1e3 for name, ms in medians.items()}
        else:  # back to back (the host launches ahead, as across a model's layers); single synchronised calls too
            fns = {name: lambda fn=fn: fn(xs[0]) for name, fn in timed.items()} | {
                "router_chain": lambda: router_chain(logits[0]), "down_projection": lambda: down_projection(xs[0]),
                "router_gemm": lambda: router_gemm(xs[0])}
            row |= {f"{name}_us": ms * 1e3 for name, ms in time_back_to_back_interleaved_ms(fns).items()}
            row |= {f"{name}_single_call_us": ms * 1e3 for name, ms in time_interleaved_ms(fns).items()}
        for name, (fn, _) in variants.items():
            if name != "eager" and not args.no_kernels:
                try:  # a diagnostic: never lose the timings above to it
                    kernels[f"M = {m}, {name}"] = kernel_times_us(lambda fn=fn: fn(xs[0]))
                except Exception as exc:  # noqa: BLE001
                    kernels[f"M = {m}, {name}"] = [(f"profiler failed: {exc!r}", float("nan"))]
        # router GEMM and routed op: what both variants run on the same kernels
        never_rewritten_us = row["untouched_us"] - row["router_chain_us"] - row["down_projection_us"]
        row["max_fused_vs_compiled"] = row["compiled_us"] / never_rewritten_us
        # the part the pass rewrites (router chain, down-projection, shared expert, norm, up-projection, add), as each
        # variant pays for it
        row["rewritten_compiled_us"] = row["compiled_us"] - never_rewritten_us
        row["rewritten_fused_us"] = row["compiled+fused_us"] - never_rewritten_us
        row["fused_vs_compiled"] = row["compiled_us"] / row["compiled+fused_us"]
        if "serving_us" in row:
            row["fused_vs_serving"] = row["serving_us"] / row["compiled+fused_us"]
            row["compiled_vs_serving"] = row["serving_us"] / row["compiled_us"]
        row["fused_no_router_vs_compiled"] = row["compiled_us"] / row["compiled+fused-no-router_us"]
        row["fused_no_overlap_vs_compiled"] = row["compiled_us"] / row["compiled+fused-no-overlap_us"]
        row["fused_no_shared_first_vs_compiled"] = row["compiled_us"] / row["compiled+fused-no-shared-first_us"]
        row["fused_x_floor"] = row["compiled+fused_us"] / block_floor_us
        if "serving_us" in row:
            row["serving_x_floor"] = row["serving_us"] / block_floor_us
        # The best fused / compiled any kernels of this library could reach (ratio_ceiling): the routed experts
        # (the same kernels in both variants) at any speed down to their floor, the compiled baseline's router
        # GEMM and rewritten part (cuBLAS and Inductor kernels) as measured, the fused block no faster than the
        # routed experts plus the down- and up-projection floors, nor than the whole block's floor.
        lat, h = cfg.latent_size, cfg.hidden_size
        serial = [floor_us(2 * (lat * h + m * (lat + h)), 2 * m * lat * h, ceilings)] * 2  # down- and up-projection
        row["serial_floor_us"] = sum(serial)
        gate_bytes = sum(t.numel() * t.element_size() for t in (block.gate_weight, block.correction_bias))
        routed_floor = row["untouched_floor_us"] - router_floor_us(gate_bytes, m, h, cfg.num_experts, ceilings)
        routed_us = routed_op_us(row)
        row["ceiling_fused_vs_compiled"] = ratio_ceiling(
            routed_us=routed_us, routed_floor_us=routed_floor,
            fixed_compiled_us=row["router_gemm_us"] + row["rewritten_compiled_us"], serial_floor_us=row["serial_floor_us"],
            block_floor_us=block_floor_us)
        row["in_a_row_at_floor_vs_compiled"], row["rest_hidden_vs_compiled"] = ratios_with_routed_as_measured(
            row["compiled_us"], routed_us, row["router_gemm_us"], row["rewritten_floor_us"], row["serial_floor_us"])
        # not a bound (see ratio_ceiling): the untouched part at its floor in both variants, the fused block at its floor
        row["all_at_floor_fused_vs_compiled"] = (row["untouched_floor_us"] + row["rewritten_compiled_us"]) / block_floor_us
        rows.append(row)
        print(row, flush=True)
    meta = environment() | {
        "serving": "serving_us: what Hopper serving runs today (bench/serving_baseline.py): the routed experts on "
                   "OpenAI's triton_kernels v3.6.0 MXFP4 MoE set up as vLLM sets it up on sm_90 (bench/peer_moe.py), "
                   "everything else the block's code compiled without the pass; fused_vs_serving = serving_us / "
                   "compiled+fused_us",
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584, H=7168, shared 768, R=1, "
                  f"router GEMM {args.router_gemm}",
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": "decode: one CUDA graph per variant over rotating inputs, replayed in 5 alternating rounds of 6 "
                  "replays, median; prefill: CUDA events around 4 calls back to back (no host sync between them: "
                  "the host launches ahead as across a model's layers), median of 5 alternating rounds; "
                  "*_single_call_us: one synchronised call per sample (all host time before the first launch "
                  "counts), median of 5 alternating rounds of 4 calls",
        "untouched": "untouched_us: router + latent down-projection + routed experts alone, compiled, in a row; "
                     "router_chain_us: the router after its GEMM alone, compiled (the router rewrite's share); "
                     "down_projection_us: the compiled down-projection alone (cuBLAS; the fused block runs its own "
                     "kernel, so it counts as rewritten); max_fused_vs_compiled = compiled_us / "
                     "(untouched_us - router_chain_us - down_projection_us): the bound for rewrites that keep router "
                     "GEMM and routed op in a row (the overlaps go beyond it); untouched_floor_us: router + routed "
                     "experts, rewritten_floor_us: everything else",
        "ceiling": "ceiling_fused_vs_compiled: the largest compiled / fused over every speed of the routed experts "
                   "(same kernels in both variants) from their floor to as measured, with the baseline's router GEMM "
                   "(router_gemm_us) and rewritten part as measured and the fused block no faster than the routed "
                   "experts + serial_floor_us (down- and up-projection floors: they run before and after the routed "
                   "experts in any schedule) nor than floor_us (bench/block.py ratio_ceiling); "
                   "all_at_floor_fused_vs_compiled = (untouched_floor_us + rewritten_compiled_us) / floor_us, "
                   "looks like a ceiling but is not a bound: a routed part faster than "
                   "measured but above its floor can give more; with the routed experts as measured "
                   "(bench/block.py ratios_with_routed_as_measured): in_a_row_at_floor_vs_compiled = compiled_us / "
                   "(routed + router_gemm_us + rewritten_floor_us), the rest at its floor without overlap; "
                   "rest_hidden_vs_compiled = compiled_us / (routed + serial_floor_us), all but the down- and "
                   "up-projection floors hidden beside the routed experts",
    }
    cols = ["M", "eager_us", "serving_us", "compiled_us", "compiled+fused_us", "floor_us", "fused_vs_serving",
            "fused_vs_compiled", "fused_x_floor", "compiled_vs_serving", "serving_x_floor", "serving_err",
            "compiled+fused-no-router_us", "fused_no_router_vs_compiled",
            "compiled+fused-no-overlap_us", "fused_no_overlap_vs_compiled",
            "compiled+fused-no-shared-first_us", "fused_no_shared_first_vs_compiled",
            "untouched_us", "router_chain_us", "down_projection_us", "max_fused_vs_compiled", "untouched_floor_us", "rewritten_floor_us", "rewritten_compiled_us",
            "rewritten_fused_us", "router_gemm_us", "serial_floor_us", "ceiling_fused_vs_compiled", "all_at_floor_fused_vs_compiled",
            "in_a_row_at_floor_vs_compiled", "rest_hidden_vs_compiled",
            "compiled_single_call_us", "compiled+fused_single_call_us",
            "compiled+fused_err", "compiled+fused_matched", "compiled+fused-no-router_matched",
            "compiled+fused-no-overlap_matched", "compiled+fused-no-shared-first_matched", "bytes_MB", "GFLOP"]
    write_results(args.name, rows, cols, meta, args.out)
    if kernels:
        (Path(args.out) / f"{args.name}_kernels.md").write_text(
            f"# {args.name}: CUDA kernel time per kernel (profiler, no CUDA graph)\n\n"
            f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}; config: {meta['config']}\n\n"
            + breakdown_markdown(kernels)
        )
    plot(rows, Path(args.out) / f"{args.name}.png")


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [r["M"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("eager_us", "serving_us", "compiled_us", "compiled+fused_us", "floor_us"):
        if all(key in r for r in rows):
            ax.plot(ms, [r[key] for r in rows], marker="o", label=key.removesuffix("_us"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens M")
    ax.set_ylabel("time per block (us)")
    ax.set_title("Kimi K3 block, one rank (H200)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
