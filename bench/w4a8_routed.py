"""The opt-in W4A8 prefill path against the default BF16-activation path, on the routed op at prefill sizes.

One EP8 rank of Kimi K3 (bench/peer_inputs.py): 112 of 896 MXFP4 experts, top-16 with the other ranks' experts at
-1, L = 3584, I = 3072, SiTU, z BF16. Rows, on the same bytes: `bf16` lmf::routed_experts as it runs by default
(the staged 128-row kernels at these M), `w4a8` the same op with LMF_ROUTED_W4A8=1 (ops/routed/w4a8_path.py:
activations in 1 x 128 e4m3 blocks, FP8 wgmma; programs of 128 weight rows, one CTA per SM), `w4a8_rows64` with the
w4a8_rows=64 override (two CTAs per SM; bitwise the same output). Times: one CUDA graph per row over rotating input sets, replayed in
alternating rounds (bench/common.time_graphs_interleaved_ms), median per call. Floors: the routed FLOPs (2 x 3 x I x L
per local pair) over the BF16 MMA rate and over the FP8 MMA rate, both measured in the same run (torch.matmul on
BF16 8192^3, torch._scaled_mm on e4m3 8192^3). Errors (one set per M): relative L2 against the exact float64 op, and
the W4A8 row against its own float64 definition (ops/routed/w4a8_numerics.routed_experts64, w4a8=True).

    PYTHONPATH=. python bench/w4a8_routed.py --out bench/results [--m 4096 8192 16384 32768]
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
    time_ms,
    write_results,
)
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

ROWS = {"bf16": {}, "w4a8": {"LMF_ROUTED_W4A8": "1"}, "w4a8_rows64": {"LMF_ROUTED_W4A8": "1", "w4a8_rows": "64"}}
SHAPE = (f"one EP8 rank of Kimi K3: {LOCAL_EXPERTS} of {GLOBAL_EXPERTS} experts MXFP4 (E8M0 per 32), top-{TOP_K} with "
         f"the other ranks' experts at -1, L={LATENT}, I={INTER}, SiTU beta={BETA} lin_beta={LIN_BETA}, z BF16")
COLUMNS = ["M", "bf16_us", "w4a8_us", "w4a8_speedup", "w4a8_rows64_us", "w4a8_rows64_speedup", "bf16_floor_us",
           "fp8_floor_us", "bf16_share_of_bf16_rate",
           "w4a8_share_of_fp8_rate", "w4a8_x_bf16_floor", "bf16_err", "w4a8_err", "w4a8_vs_definition_err",
           "local_pairs", "hit_experts", "sets"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return prefill_args(__doc__.split("\n\n")[0], argv)


def fp8_flop_per_s() -> float:
    """Measured dense e4m3 MMA rate: torch._scaled_mm on 8192^3 with per-tensor scales (FP32 out)."""
    k = 8192
    a = torch.randn(k, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(k, k, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), warmup=5, iters=20)
    return 2 * k**3 / (ms * 1e-3)


def definition64(s, w: dict[str, torch.Tensor]) -> torch.Tensor:
    from latent_moe_fusion.ops.routed.w4a8_numerics import routed_experts64

    return routed_experts64(s.z, s.ids, s.weights, w["w13"], w["w2"], w["w13_scale"], w["w2_scale"], BETA, LIN_BETA,
                            w4a8=True)


def timing_row(m: int, w: dict[str, torch.Tensor], gen: torch.Generator, ceilings: dict[str, float]) -> dict:
    sets = [rank_inputs(m, gen, "cuda") for _ in range(2)]
    while len(sets) < sets_to_flush_l2(int(floor_terms(sets[0])[0])):
        sets.append(rank_inputs(m, gen, "cuda"))
    fns = {name: routed_with_knobs(w, knobs) for name, knobs in ROWS.items()}
    s = sets[0]
    exact = routed_float64(s, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    outs = {name: fn(s.z, s.ids, s.weights) for name, fn in fns.items()}
    assert torch.equal(outs["w4a8"], outs["w4a8_rows64"]), "the W4A8 program widths disagree"
    row = {"M": m, "sets": len(sets), "local_pairs": sum(x.assignments() for x in sets) / len(sets),
           "hit_experts": sum(x.hit_experts() for x in sets) / len(sets),
           "bf16_err": rel_l2(outs["bf16"], exact), "w4a8_err": rel_l2(outs["w4a8"], exact),
           "w4a8_vs_definition_err": rel_l2(outs["w4a8"], definition64(s, w))}
    del exact, outs
    flops = sum(floor_terms(x)[1] for x in sets) / len(sets)
    row["bf16_floor_us"] = flops / ceilings["bf16_flop_per_s"] * 1e6
    row["fp8_floor_us"] = flops / ceilings["fp8_flop_per_s"] * 1e6
    steps = {name: (lambda i, fn=fn: fn(sets[i].z, sets[i].ids, sets[i].weights)) for name, fn in fns.items()}
    medians = time_graphs_interleaved_ms(steps, len(sets), replays=4 if m <= 8192 else 2)
    row["bf16_us"], row["w4a8_us"] = medians["bf16"] * 1e3, medians["w4a8"] * 1e3
    row["w4a8_rows64_us"] = medians["w4a8_rows64"] * 1e3
    row["w4a8_speedup"] = row["bf16_us"] / row["w4a8_us"]
    row["w4a8_rows64_speedup"] = row["bf16_us"] / row["w4a8_rows64_us"]
    row["bf16_share_of_bf16_rate"] = row["bf16_floor_us"] / row["bf16_us"]
    row["w4a8_share_of_fp8_rate"] = row["fp8_floor_us"] / row["w4a8_us"]
    row["w4a8_x_bf16_floor"] = row["w4a8_us"] / row["bf16_floor_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import latent_moe_fusion  # noqa: F401  (registers lmf::routed_experts)

    if not torch.cuda.is_available():
        print("w4a8_routed: needs a CUDA GPU (sm_90)")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    w = rank_weights(gen, "cuda")
    ceilings = measure_ceilings() | {"fp8_flop_per_s": fp8_flop_per_s()}
    rows = []
    for m in args.m:
        rows.append(timing_row(m, w, gen, ceilings))
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        torch.cuda.empty_cache()
    meta = {"shape": SHAPE, "environment": environment(),
            "bf16_tflops": round(ceilings["bf16_flop_per_s"] / 1e12, 1),
            "fp8_tflops": round(ceilings["fp8_flop_per_s"] / 1e12, 1),
            "rows": "bf16: lmf::routed_experts by default; w4a8: the same with LMF_ROUTED_W4A8=1 (128 weight rows a "
                    "program); w4a8_rows64: with the w4a8_rows=64 override",
            "floors": "routed FLOPs over the measured BF16 and FP8 MMA rates"}
    write_results("w4a8_routed", rows, COLUMNS, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
