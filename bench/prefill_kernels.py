"""The kernels of the 128-row prefill blocks side by side (the staged_kernel tuning override), on the routed op and
kernel by kernel.

One EP8 rank of Kimi K3 (bench/peer_inputs.py): 112 of 896 MXFP4 experts, top-16 with the other ranks' experts at
-1, L = 3584, I = 3072, SiTU, z BF16. Rows, on the same bytes, lmf::routed_experts with staged_kernel =
  staged  ops/routed/gluon/routed_staged.py: the weights dequantised into shared memory, both wgmma operands from
          there, every warp dequantises and issues its wgmma each 64-wide k step, two CTAs per SM;
  kappa   routed_kappa.py: the weights dequantised into the wgmma's register operand, the activations in kappa
          order by TMA (L1's block rows gathered first by triton/kappa_columns.py), two CTAs per SM, the MMA's N by
          each block's valid rows in tiers (16, 32, 64, 64 + 16, 64 + 32, 128);
  kappa_plain  the same kernels with N = 64 or 128 only;
  ws      routed_staged_ws.py: the staged kernels' work split over loader, dequantiser and MMA partitions handing
          mbarrier ring stages over, one persistent CTA per SM.
Times: one CUDA graph per row over rotating input sets, replayed in 11 alternating rounds
(bench/common.time_graphs_interleaved_ms), median per call; L1, L2 and the kappa gather's kernel times from the PyTorch
profiler outside graphs. Floor: the routed FLOPs (2 x 3 x I x L per local pair) over the BF16 MMA rate measured in the
same run. staged and ws must agree bit for bit (checked; the same MMAs in the same order); kappa sums in another k
order. Errors: relative L2 against the exact float64 op.

    PYTHONPATH=. python bench/prefill_kernels.py --out bench/results [--m 4096 8192 16384 32768]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    environment,
    measure_ceilings,
    rel_l2,
    sets_to_flush_l2,
    time_graphs_interleaved_ms,
    write_results,
)
from bench.kernel_breakdown import profiled_kernels  # noqa: E402
from bench.peer_inputs import (  # noqa: E402
    BETA,
    GLOBAL_EXPERTS,
    INTER,
    LATENT,
    LIN_BETA,
    LOCAL_EXPERTS,
    TOP_K,
    floor_terms,
    prefill_args,
    rank_inputs,
    rank_weights,
    routed_float64,
    routed_with_knobs,
)

ROWS = {name: {"staged_kernel": name} for name in ("staged", "kappa_plain", "kappa", "ws")}
KERNELS = {name: (f"l1_{family}_kernel", f"l2_{family}_kernel")
           for name, family in (("staged", "staged"), ("kappa_plain", "kappa"), ("kappa", "kappa"), ("ws", "ws"))}
GATHER_KERNEL = "gather_kappa_rows_kernel"
SHAPE = (f"one EP8 rank of Kimi K3: {LOCAL_EXPERTS} of {GLOBAL_EXPERTS} experts MXFP4 (E8M0 per 32), top-{TOP_K} with "
         f"the other ranks' experts at -1, L={LATENT}, I={INTER}, SiTU beta={BETA} lin_beta={LIN_BETA}, z BF16")
COLUMNS = ["M", "staged_us", "kappa_plain_us", "kappa_us", "ws_us", "kappa_speedup", "tiers_speedup", "ws_speedup",
           "floor_us", "staged_share_of_bf16_rate", "kappa_plain_share_of_bf16_rate", "kappa_share_of_bf16_rate",
           "ws_share_of_bf16_rate", "staged_l1_us", "kappa_plain_l1_us", "kappa_l1_us", "ws_l1_us", "staged_l2_us",
           "kappa_plain_l2_us", "kappa_l2_us", "ws_l2_us", "kappa_gather_us", "ws_bitwise_staged", "staged_err",
           "kappa_plain_err", "kappa_err", "ws_err", "local_pairs", "hit_experts", "sets"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return prefill_args(__doc__.split("\n\n")[0], argv)


def kernel_us(fn, names: tuple[str, ...]) -> tuple[float, ...]:
    """µs per call of the kernels named (the profiler's kernel names start with them)."""
    times = {name: us for name, _, us in profiled_kernels(fn, iters=3)}
    return tuple(sum(us for k, us in times.items() if k.startswith(n)) for n in names)


def timing_row(m: int, w: dict[str, torch.Tensor], gen: torch.Generator, ceilings: dict[str, float]) -> dict:
    sets = [rank_inputs(m, gen, "cuda") for _ in range(2)]
    while len(sets) < sets_to_flush_l2(int(floor_terms(sets[0])[0])):
        sets.append(rank_inputs(m, gen, "cuda"))
    fns = {name: routed_with_knobs(w, knobs) for name, knobs in ROWS.items()}
    s = sets[0]
    outs = {name: fn(s.z, s.ids, s.weights) for name, fn in fns.items()}
    exact = routed_float64(s, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    row = {"M": m, "sets": len(sets), "local_pairs": sum(x.assignments() for x in sets) / len(sets),
           "hit_experts": sum(x.hit_experts() for x in sets) / len(sets),
           "ws_bitwise_staged": bool(torch.equal(outs["staged"], outs["ws"])),
           **{f"{name}_err": rel_l2(out, exact) for name, out in outs.items()}}
    del outs, exact
    flops = sum(floor_terms(x)[1] for x in sets) / len(sets)
    row["floor_us"] = flops / ceilings["bf16_flop_per_s"] * 1e6
    for name, fn in fns.items():
        row[f"{name}_l1_us"], row[f"{name}_l2_us"], gather = kernel_us(lambda fn=fn: fn(s.z, s.ids, s.weights),
                                                                       (*KERNELS[name], GATHER_KERNEL))
        if name == "kappa":
            row["kappa_gather_us"] = gather
    steps = {name: (lambda i, fn=fn: fn(sets[i].z, sets[i].ids, sets[i].weights)) for name, fn in fns.items()}
    medians = time_graphs_interleaved_ms(steps, len(sets), rounds=11, replays=4 if m <= 8192 else 2)
    for name in fns:
        row[f"{name}_us"] = medians[name] * 1e3
        row[f"{name}_share_of_bf16_rate"] = row["floor_us"] / row[f"{name}_us"]
    row["kappa_speedup"] = row["staged_us"] / row["kappa_us"]
    row["tiers_speedup"] = row["kappa_plain_us"] / row["kappa_us"]
    row["ws_speedup"] = row["staged_us"] / row["ws_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import latent_moe_fusion  # noqa: F401  (registers lmf::routed_experts)

    if not torch.cuda.is_available():
        print("prefill_kernels: needs a CUDA GPU (sm_90)")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    w = rank_weights(gen, "cuda")
    ceilings = measure_ceilings()
    rows = []
    for m in args.m:
        rows.append(timing_row(m, w, gen, ceilings))
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        torch.cuda.empty_cache()
    meta = {"shape": SHAPE, "environment": environment(),
            "bf16_tflops": round(ceilings["bf16_flop_per_s"] / 1e12, 1),
            "rows": "lmf::routed_experts with the staged_kernel override staged, kappa_plain, kappa, ws",
            "floor": "routed FLOPs over the measured BF16 MMA rate"}
    write_results("prefill_kernels", rows, COLUMNS, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
