"""The decode front alone (H = 7168, L = 3584, I_s = 768, BF16): the latent down-projection z = x @ w_down^T and
the shared expert's act = SiTU(x @ w1_s^T, x @ w3_s^T), as the separate kernels (the Triton down-projection,
cuBLAS's gate/up GEMM, the SiTU pass: what the shared-first schedule ran before) against one launch
(ops/front.py), over decode M.

Each variant is one CUDA graph over rotating weight copies (L2-cold), the graphs replayed in alternating
rounds; the separate kernels run one after the other on one stream. Floor: bytes of the three weights + x + z
+ act once over the measured copy bandwidth. Errors: relative L2 of z and act against float64.

    PYTHONPATH=. python3 bench/front.py --out bench/results                 # the table's configs
    PYTHONPATH=. python3 bench/front.py --out DIR --configs LABEL ...        # other configs too
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graphs_interleaved_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.down_projection import project_down_triton  # noqa: E402
from latent_moe_fusion.ops.down_projection import table_config as down_config  # noqa: E402
from latent_moe_fusion.ops.front import front_fused, parse_label, table_config  # noqa: E402
from latent_moe_fusion.ops.math import situ  # noqa: E402
from latent_moe_fusion.ops.triton_kernels.situ_rows import situ_pair  # noqa: E402

H, L, I_S = 7168, 3584, 768
BETA, LIN_BETA = 1.0, 1.0
DECODE_M = (5, 8, 16, 32, 64)
WEIGHT_SETS = 4  # 4 x 73 MB: every call reads its weights from HBM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(DECODE_M))
    ap.add_argument("--configs", nargs="*", default=[], help="extra front labels, timed where block_m >= M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--name", default="front")
    args = ap.parse_args()
    extra = [parse_label(label) for label in args.configs]
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    w_down = [torch.randn(L, H, device="cuda", dtype=torch.bfloat16) * H**-0.5 for _ in range(WEIGHT_SETS)]
    w13 = [torch.randn(2 * I_S, H, device="cuda", dtype=torch.bfloat16) * 4 * H**-0.5 for _ in range(WEIGHT_SETS)]
    rows = []
    for m in args.m:
        xs = [torch.randn(m, H, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_SETS)]
        zs = [torch.empty(m, L, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_SETS)]
        acts = [torch.empty(m, I_S, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_SETS)]
        configs = {"one launch, table": table_config(m)} | {cfg.label(): cfg for cfg in extra if cfg.block_m >= m}
        configs = {name: cfg for name, cfg in configs.items() if cfg is not None}

        def separate(i: int) -> None:
            project_down_triton(xs[i], w_down[i], zs[i], down_config(m))
            h = torch.mm(xs[i], w13[i].t())
            acts[i].copy_(situ_pair(h[:, :I_S], h[:, I_S:], BETA, LIN_BETA))

        steps = {"separate": separate}
        for name, cfg in configs.items():
            steps[name] = lambda i, cfg=cfg: front_fused(xs[i], w_down[i], w13[i][:I_S], w13[i][I_S:], zs[i], acts[i],
                                                         BETA, LIN_BETA, cfg)
        xd = xs[0].double()
        ref_z = xd @ w_down[0].double().t()
        ref_act = situ(xd @ w13[0][:I_S].double().t(), xd @ w13[0][I_S:].double().t(), BETA, LIN_BETA)
        errors = {}
        for name, step in steps.items():
            zs[0].fill_(float("nan"))  # poison: every element must be written
            acts[0].fill_(float("nan"))
            step(0)
            errors[name] = (rel_l2(zs[0], ref_z), rel_l2(acts[0], ref_act))
        times = time_graphs_interleaved_ms(steps, WEIGHT_SETS, rounds=args.rounds)
        floor_us = ((L + 2 * I_S) * H + m * (H + L + I_S)) * 2 / ceilings["copy_bytes_per_s"] * 1e6
        for name in steps:
            us = times[name] * 1e3
            rows.append({"M": m, "variant": name, "config": configs[name].label() if name in configs else
                         f"{down_config(m).label()} + torch.mm + situ_pair", "us": us, "floor_us": floor_us,
                         "x_floor": us / floor_us, "vs_separate": times["separate"] / times[name],
                         "z_rel_l2_vs_fp64": errors[name][0], "act_rel_l2_vs_fp64": errors[name][1]})
            print(rows[-1], flush=True)
    meta = environment() | {
        "shape": f"x [M, {H}]: z = x @ w_down[{L}, {H}]^T, act = SiTU(x @ w1_s[{I_S}, {H}]^T, x @ w3_s^T), bf16, "
                 "FP32 accumulation",
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "timing": f"one CUDA graph per variant over {WEIGHT_SETS} weight copies (L2-cold), {args.rounds} alternating "
                  "rounds of 6 replays, median per call",
        "floor": "bytes of w_down + w1_s + w3_s + x + z + act once / copy bandwidth",
    }
    write_results(args.name, rows, ["M", "variant", "config", "us", "floor_us", "x_floor", "vs_separate",
                                    "z_rel_l2_vs_fp64", "act_rel_l2_vs_fp64"], meta, args.out)


if __name__ == "__main__":
    main()
