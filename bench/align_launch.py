"""The one-program token grouping (ops/routed/triton/moe_align._align_kernel) by warps and pairs per step.

Decode and small prefill batches (below moe_align.SPREAD_MIN_PAIRS pairs) group their (token, slot) pairs by
expert in one program: histogram, block ranges, the padding fill, then each pair takes a row by an atomic. It
sits on the routed experts' critical path in both the compiled and the fused block (the routed GEMMs wait for
it). Inputs: one Kimi K3 EP8 rank's share of a top-16 routing over 896 experts (112 local, others -1), fresh
per set; each setting runs in a CUDA graph over 8 rotating id sets (bench.common.time_graph_ms). Every
setting's grouping is checked against the library's (same blocks, same pairs per expert). `library` marks the
launch group_by_expert uses (ALIGN_WARPS, align_chunk); `before` the one it replaced (4 warps, the pairs'
power of two up to 1024 per step). Floor: one kernel's replay time in the same kind of graph is the practical
floor at these sizes (bench/route.md, `one_kernel_us` ~2.5 us).

    PYTHONPATH=. python3 bench/align_launch.py --out bench/results [--m 8 32 128 256 511]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.ops.routed.triton import moe_align  # noqa: E402

EXPERTS, LOCAL, TOP_K, SETS = 896, 112, 16, 8
WARPS = (4, 8, 16)
CHUNKS = (512, 1024, 2048)


def rank_ids(m: int) -> torch.Tensor:
    """[m, TOP_K] int32: each token's TOP_K distinct experts of EXPERTS, this rank's first LOCAL kept, others -1."""
    ids = torch.rand(m, EXPERTS, device="cuda").argsort(dim=1)[:, :TOP_K].int()
    return torch.where(ids < LOCAL, ids, -1).contiguous()


def same_grouping(a: moe_align.Grouping, b: moe_align.Grouping) -> bool:
    """Same blocks' experts and the same pairs in them (the row order inside an expert is the atomics')."""
    return torch.equal(a.block_expert, b.block_expert) and torch.equal(a.sorted_pairs.sort().values,
                                                                         b.sorted_pairs.sort().values)


def time_launch(sets: list[torch.Tensor], block_m: int, warps: int, chunk: int) -> tuple[float, moe_align.Grouping]:
    """Median us per grouping of one set with this launch, and the grouping of sets[0]."""
    nb_max = moe_align.max_blocks(sets[0].numel(), LOCAL, block_m)
    grouping = moe_align.Grouping(torch.empty(nb_max * block_m, dtype=torch.int32, device="cuda"),
                                  torch.empty(nb_max, dtype=torch.int32, device="cuda"), nb_max, block_m)
    scratch = torch.empty(2 * triton.next_power_of_2(LOCAL), dtype=torch.int32, device="cuda")

    def step(i: int) -> None:
        moe_align.launch_one_program(sets[i], LOCAL, grouping, scratch, warps, chunk)

    step(0)
    torch.cuda.synchronize()
    first = moe_align.Grouping(grouping.sorted_pairs.clone(), grouping.block_expert.clone(), nb_max, block_m)
    return time_graph_ms(step, len(sets)) * 1e3, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[8, 32, 128, 256, 511])
    ap.add_argument("--block-m", type=int, nargs="*", default=[16, 32])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for m in args.m:
        sets = [rank_ids(m) for _ in range(SETS)]
        num_pairs = m * TOP_K
        assert num_pairs < moe_align.SPREAD_MIN_PAIRS, f"M = {m}: the spread kernels group {num_pairs} pairs"
        before = (4, min(1024, max(16, triton.next_power_of_2(num_pairs))))
        library = (moe_align.ALIGN_WARPS, moe_align.align_chunk(num_pairs))
        for block_m in args.block_m:
            reference = moe_align.group_by_expert(sets[0], LOCAL, block_m, spread=False)
            settings = sorted({(w, c) for w in WARPS for c in CHUNKS} | {before, library})
            times = {}
            for warps, chunk in settings:
                us, grouping = time_launch(sets, block_m, warps, chunk)
                times[warps, chunk] = us
                rows.append({"M": m, "block_m": block_m, "pairs": num_pairs, "warps": warps, "chunk": chunk,
                             "us": us, "launch": "library" if (warps, chunk) == library else
                             "before" if (warps, chunk) == before else "",
                             "same_grouping": same_grouping(grouping, reference)})
            for row in rows[-len(settings):]:
                row["vs_before"] = times[before] / row["us"]
                print(row, flush=True)
    write_results("align_launch", rows, ["M", "block_m", "pairs", "warps", "chunk", "launch", "us", "vs_before",
                                         "same_grouping"],
                  environment() | {"config": f"Kimi K3 EP8 rank: {LOCAL} of {EXPERTS} experts local, top-{TOP_K}",
                                   "timing": f"CUDA graph over {SETS} rotating id sets, median replay / {SETS}"},
                  args.out, notes="library: the launch group_by_expert uses (moe_align.ALIGN_WARPS, align_chunk); "
                                  "before: the launch it replaced (4 warps, the pairs' power of two up to 1024 per "
                                  "step). vs_before: before's time over this one. same_grouping: the blocks' experts "
                                  "and the pairs per block equal the library's grouping (the row order inside an "
                                  "expert is the atomics').")


if __name__ == "__main__":
    main()
