"""What-if: the tail's up-projection weight streamed into L2 while the routed kernels run.

The routed L1 / L2 kernels reach ~2.7-2.9 TB/s of the ~4.2 TB/s copy rate (issue-bound), and the tail
then reads w_up (51 MB at Kimi K3 widths) from HBM. This times the compiled + fused block with a side-stream
kernel that issues L2 prefetches of the first N MB of w_up when L1 or L2 is launched (bulk prefetches
`cp.async.bulk.prefetch.L2` with an evict_last or the default policy, or one `prefetch.global.L2::evict_last`
per 128-byte line), against the block as it is, in CUDA graphs over rotating inputs, alternating rounds.
Outputs are checked bitwise against the block without prefetch (a prefetch moves no data the kernels see).

    PYTHONPATH=. python3 bench/tail_prefetch_whatif.py --m 8 32 128 --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import compiled_rank_block, decode_inputs  # noqa: E402
from bench.common import environment, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.common.side_streams import side_stream  # noqa: E402
from latent_moe_fusion.ops.routed import expert_schedule  # noqa: E402

BULK_BYTES = 16384  # bytes per bulk prefetch (one per thread)
LINE_BYTES = 128
PREFETCH_PTX = {
    "bulk evict_last": f"""{{
.reg .b64 pol;
createpolicy.fractional.L2::evict_last.b64 pol, 1.0;
cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {BULK_BYTES}, pol;
mov.u32 $0, 0;
}}""",
    "bulk": f"""{{
cp.async.bulk.prefetch.L2.global [$1], {BULK_BYTES};
mov.u32 $0, 0;
}}""",
    "line evict_last": """{
prefetch.global.L2::evict_last [$1];
mov.u32 $0, 0;
}""",
}
PER_PROGRAM = 128  # prefetches per program (one per thread of 4 warps)


@triton.jit
def _prefetch_kernel(base, sink, PTX: tl.constexpr, PER: tl.constexpr, STEP: tl.constexpr):
    pid = tl.program_id(0)
    addr = base + (pid * PER + tl.arange(0, PER)).to(tl.int64) * STEP
    done = tl.inline_asm_elementwise(PTX, "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink + pid, tl.sum(done, 0))  # keeps the asm


@contextlib.contextmanager
def prefetch_beside(weight: torch.Tensor, site: str, megabytes: int, form: str):
    """While active, launching the routed `site` kernel ("l1" / "l2") forks a side stream that prefetches
    the first `megabytes` MB of `weight` and joins it after the launch."""
    real = {"l1": expert_schedule.launch_routed_l1, "l2": expert_schedule.launch_routed_l2}
    step = LINE_BYTES if form.startswith("line") else BULK_BYTES
    programs = max(1, min(megabytes * 2**20, weight.numel() * weight.element_size()) // (step * PER_PROGRAM))
    sink = torch.zeros(programs, dtype=torch.int32, device=weight.device)

    def launching(*args, **kwargs):
        main = torch.cuda.current_stream(weight.device)
        side = side_stream(weight.device, "tail_prefetch_whatif")
        side.wait_stream(main)
        with torch.cuda.stream(side):
            _prefetch_kernel[(programs,)](weight.data_ptr(), sink, PTX=PREFETCH_PTX[form], PER=PER_PROGRAM,
                                          STEP=step, num_warps=4)
        out = real[site](*args, **kwargs)
        main.wait_stream(side)
        return out

    setattr(expert_schedule, f"launch_routed_{site}", launching)
    try:
        yield
    finally:
        setattr(expert_schedule, f"launch_routed_{site}", real[site])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[8, 32, 128])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    block, base, fused, _ = compiled_rank_block()
    variants = {"no prefetch": None}
    variants |= {f"at L2, bulk evict_last, {mb} MB": ("l2", mb, "bulk evict_last") for mb in (8, 16, 24, 36)}
    variants |= {"at L2, bulk, 16 MB": ("l2", 16, "bulk"), "at L2, line evict_last, 16 MB": ("l2", 16, "line evict_last"),
                 "at L1, bulk evict_last, 16 MB": ("l1", 16, "bulk evict_last"),
                 "at L1, bulk evict_last, 24 MB": ("l1", 24, "bulk evict_last")}

    def under(spec):
        return prefetch_beside(block.w_up, *spec) if spec else contextlib.nullcontext()

    rows = []
    for m in args.m:
        xs = decode_inputs(block, m)
        want = fused(xs[0]).clone()
        bitwise = {}
        for name, spec in variants.items():
            with under(spec):
                bitwise[name] = torch.equal(fused(xs[0]), want)
        samples: dict[str, list[float]] = {name: [] for name in ["compiled", *variants]}
        for _ in range(args.rounds):
            samples["compiled"].append(time_graph_ms(lambda i: base(xs[i]), len(xs)) * 1e3)
            for name, spec in variants.items():
                with under(spec):
                    samples[name].append(time_graph_ms(lambda i: fused(xs[i]), len(xs)) * 1e3)
        med = {name: statistics.median(v) for name, v in samples.items()}
        for name in variants:
            rows.append({"M": m, "variant": name, "us": med[name], "vs_no_prefetch": med["no prefetch"] / med[name],
                         "fused_vs_compiled": med["compiled"] / med[name], "bitwise": bitwise[name]})
        rows.append({"M": m, "variant": "compiled (no pass)", "us": med["compiled"], "vs_no_prefetch": float("nan"),
                     "fused_vs_compiled": 1.0, "bitwise": ""})
        for row in rows[-len(variants) - 1:]:
            print(row, flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8: 112/896 experts MXFP4, top-16, router GEMM bf16 (bench/block.py); "
                  "w_up 7168 x 3584 bf16 (51.4 MB)",
        "timing": f"CUDA graph replay over 4 rotating inputs, median of {args.rounds} alternating rounds",
    }
    write_results("tail_prefetch_whatif", rows, ["M", "variant", "us", "vs_no_prefetch", "fused_vs_compiled",
                                                 "bitwise"], meta, args.out)


if __name__ == "__main__":
    main()
