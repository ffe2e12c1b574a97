"""What the decode block could gain if the shared expert ran off the critical path (a what-if bound).

`lmf::moe_shared_producer` receives the latent z, so the shared expert, which needs only x, starts after
the router and the latent down-projection (DESIGN.md §2). This times the compiled + fused block as it
is and with the producer's shared expert left out (its fragments are then never written: the output is
wrong and only the time is kept), against compiled without the pass, in CUDA graphs over rotating
inputs. fused - fused without shared is the most that starting the shared expert before the router
could save: the whole of its cost on the producer's span, as if it overlapped the router for free.

    PYTHONPATH=. python3 bench/shared_overlap_bound.py --m 1 8 --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compiled_rank_block, decode_inputs  # noqa: E402
from bench.common import environment, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.routed import producer_triton_backend as producer  # noqa: E402


@contextlib.contextmanager
def shared_expert_left_out():
    """The Triton producer backend runs its routed experts and RMSNorm only (what-if timing, wrong ws)."""
    real = producer.run_experts

    def routed_only(*args, **kwargs):
        kwargs["shared"] = None
        return real(*args, **kwargs)

    producer.run_experts = routed_only
    try:
        yield
    finally:
        producer.run_experts = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    block, base, fused, fpass = compiled_rank_block()
    rows = []
    for m in args.m:
        xs = decode_inputs(block, m)
        variants = {"compiled": (base, contextlib.nullcontext), "compiled+fused": (fused, contextlib.nullcontext),
                    "compiled+fused, shared expert left out": (fused, shared_expert_left_out)}
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (fn, ctx) in variants.items():
                with ctx():
                    samples[name].append(time_graph_ms(lambda i, fn=fn: fn(xs[i]), len(xs)) * 1e3)
        med = {name: statistics.median(v) for name, v in samples.items()}
        bound = med["compiled+fused"] - med["compiled+fused, shared expert left out"]
        for name in variants:
            rows.append({"M": m, "variant": name, "us": med[name], "vs_compiled": med["compiled"] / med[name],
                         "shared_on_span_us": bound, "matched": fpass.report.matched if "fused" in name else 0})
            print(rows[-1], flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, I=3072, L=3584, H=7168, shared 768, "
                  "R=1, router GEMM bf16",
        "timing": f"CUDA graph replay over 4 rotating inputs, median of {args.rounds} alternating rounds",
        "note": "shared expert left out: the producer's shared fragments are never written (what-if timing only); "
                "shared_on_span_us = fused - fused without the shared expert",
    }
    write_results("shared_overlap_bound", rows, ["M", "variant", "us", "vs_compiled", "shared_on_span_us", "matched"],
                  meta, args.out)


if __name__ == "__main__":
    main()
