"""The router after its GEMM at every batch size: the unfused chain (sigmoid, bias, torch.topk, gather,
renormalise, EP share) eager and compiled, against lmf::noaux_tc_route (what the pass rewrites it into).

Kimi K3 one rank of EP8: E = 896 logits per token, top-16, this rank's 112 experts kept (others -1).
Each variant runs in a CUDA graph over rotating logit sets (decode: the launches are replayed, as in
serving); M = 4096 too, for the prefill share. Floor: logits, bias, ids and weights moved once over the
measured copy bandwidth; at decode one kernel's replay time (`one_kernel_us`, a 1-element fill in the
same kind of graph) is the practical floor. Also checked: the fused ids equal the compiled chain's
bitwise, and the weights' relative L2 difference (the FP32 sum runs in another order).

    PYTHONPATH=. python3 bench/route.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latent_moe_fusion as lmf  # noqa: E402
from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.model.router import localize_ids, route_from_logits  # noqa: E402

EXPERTS, TOP_K, LOCAL = 896, 16, 112


def router_chain(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """model/router.route after its GEMM, then localize_ids for EP rank 0 of 8 (as the block runs it)."""
    ids, weights = route_from_logits(logits, bias, TOP_K, 1.0)
    return localize_ids(ids, 0, LOCAL), weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 32, 128, 1024, 4096])
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    torch._inductor.config.fx_graph_cache = False
    ceilings = measure_ceilings()
    bias = torch.randn(EXPERTS, device="cuda") * 0.1
    fpass = lmf.LatentMoEFusionPass()
    variants = {
        "eager": router_chain,
        "compiled": torch.compile(router_chain, dynamic=False),
        "compiled+fused": torch.compile(router_chain, dynamic=False, options={"post_grad_custom_pre_pass": fpass}),
    }
    one = torch.empty(1, device="cuda")
    one_kernel_us = time_graph_ms(lambda i: one.fill_(i), 4) * 1e3
    rows = []
    for m in args.m:
        sets = 4 if m <= 128 else 2
        logits = [torch.randn(m, EXPERTS, device="cuda") for _ in range(sets)]
        nbytes = m * EXPERTS * 4 + EXPERTS * 4 + m * TOP_K * 8
        floor_us = nbytes / ceilings["copy_bytes_per_s"] * 1e6
        results = {name: fn(logits[0], bias) for name, fn in variants.items()}
        row = {"M": m, "floor_us": floor_us, "one_kernel_us": one_kernel_us,
               "fused_routers": len(fpass.report.routings),
               "ids_equal_compiled": bool(torch.equal(results["compiled+fused"][0], results["compiled"][0])),
               "rows_equal_eager": float((results["compiled+fused"][0] == results["eager"][0]).all(-1).float().mean()),
               "weights_rel_l2_vs_compiled": rel_l2(results["compiled+fused"][1], results["compiled"][1])}
        for name, fn in variants.items():
            row[f"{name}_us"] = time_graph_ms(lambda i, fn=fn: fn(logits[i], bias), sets) * 1e3
        row["fused_vs_compiled"] = row["compiled_us"] / row["compiled+fused_us"]
        row["fused_x_floor"] = row["compiled+fused_us"] / floor_us
        rows.append(row)
        print(row, flush=True)
    meta = environment() | {
        "config": f"router chain after the GEMM: E = {EXPERTS} FP32 logits, top-{TOP_K}, EP share {LOCAL} experts",
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "timing": "CUDA graph replay over rotating logit sets, median",
    }
    cols = ["M", "eager_us", "compiled_us", "compiled+fused_us", "fused_vs_compiled", "floor_us", "fused_x_floor",
            "one_kernel_us", "ids_equal_compiled", "rows_equal_eager", "weights_rel_l2_vs_compiled", "fused_routers"]
    write_results("route", rows, cols, meta, args.out)


if __name__ == "__main__":
    main()
