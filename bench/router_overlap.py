"""The router beside the down-projection: lmf::route_and_project on one stream (router GEMM -> route ->
down-projection, as the compiled unfused graph runs them) against side by side (the down-projection on a
side stream forked before the router), per batch size; its threshold OVERLAP_MAX_TOKENS comes from here.

Kimi K3 one rank of EP8: x [M, 7168] bf16, gate [896, 7168] bf16 (BF16 GEMM, FP32 logits), top-16 kept
on this rank's 112 experts, W_down [3584, 7168] bf16. Each variant runs in a CUDA graph over rotating
weight sets (so every call reads its weights from HBM). Floor: the bytes moved once (both weights, x,
z, logits written and read, ids and weights) over the measured copy bandwidth. Also checked: both ways
give bitwise the same ids, weights and z.

    PYTHONPATH=. python3 bench/router_overlap.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latent_moe_fusion as lmf  # noqa: E402,F401  (registers torch.ops.lmf.*)
from bench.common import environment, measure_ceilings, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion import tuning  # noqa: E402
from latent_moe_fusion.ops.common.route_math import router_logits  # noqa: E402
from latent_moe_fusion.ops.routed.router_fused.route_and_project import OVERLAP_MAX_TOKENS, OVERLAP_OVERRIDE  # noqa: E402

HIDDEN, EXPERTS, LATENT, TOP_K, LOCAL = 7168, 896, 3584, 16, 112
WEIGHT_SETS = 4  # 4 x 64 MB of weights per replay: well past the 50 MB L2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    args = ap.parse_args()
    ceilings = measure_ceilings()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = [((torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16(),
             torch.randn(EXPERTS, device="cuda", generator=gen) * 0.1,
             (torch.randn(LATENT, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16())
            for _ in range(WEIGHT_SETS)]
    op = torch.ops.lmf.route_and_project

    def call(x, i):
        gate, bias, w_down = sets[i]
        return op(x, gate, bias, w_down, "bf16", TOP_K, 1e-20, 1.0, 0, LOCAL)

    rows = []
    for m in args.m:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        row = {"M": m}
        outs = {}
        for name, flag in (("one_stream", False), ("side_by_side", True)):
            with tuning.overrides(router_overlap_streams=flag):
                outs[name] = call(x, 0)
                row[f"{name}_us"] = time_graph_ms(lambda i: call(x, i), WEIGHT_SETS) * 1e3
        row["down_projection_alone_us"] = time_graph_ms(lambda i: torch.mm(x, sets[i][2].t()), WEIGHT_SETS) * 1e3
        row["router_alone_us"] = time_graph_ms(lambda i: torch.ops.lmf.noaux_tc_route(
            router_logits(x, sets[i][0], "bf16"), sets[i][1], TOP_K, 1e-20, 1.0, 0, LOCAL), WEIGHT_SETS) * 1e3
        nbytes = (EXPERTS + LATENT) * HIDDEN * 2 + m * HIDDEN * 2 + m * LATENT * 2 + 2 * m * EXPERTS * 4 + m * TOP_K * 8
        row["floor_us"] = nbytes / ceilings["copy_bytes_per_s"] * 1e6
        row["side_by_side_speedup"] = row["one_stream_us"] / row["side_by_side_us"]
        row["side_by_side_x_floor"] = row["side_by_side_us"] / row["floor_us"]
        row["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(outs["one_stream"], outs["side_by_side"], strict=True))
        row["default"] = "side_by_side" if m <= OVERLAP_MAX_TOKENS else "one_stream"
        rows.append(row)
        print(row, flush=True)
    meta = environment() | {
        "config": f"Kimi K3 rank of EP8: H = {HIDDEN}, E = {EXPERTS} (BF16 GEMM, FP32 logits), top-{TOP_K}, "
                  f"{LOCAL} local experts, L = {LATENT}",
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "timing": f"CUDA graph replay over {WEIGHT_SETS} rotating weight sets, median",
        "threshold": f"OVERLAP_MAX_TOKENS = {OVERLAP_MAX_TOKENS} (side by side up to it; the {OVERLAP_OVERRIDE} tuning override False / True forces)",
    }
    cols = ["M", "one_stream_us", "side_by_side_us", "side_by_side_speedup", "down_projection_alone_us",
            "router_alone_us", "floor_us", "side_by_side_x_floor", "bitwise_equal", "default"]
    write_results("router_overlap", rows, cols, meta, args.out)


if __name__ == "__main__":
    main()
