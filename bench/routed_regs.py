"""Routed MXFP4 decode GEMMs: the Triton kernels (dequantised tile staged through shared memory) against
the Gluon register-dequant kernels (ops/routed/gluon), on the same inputs.

The routed op alone (grouping, L1 + SiTU, L2, combine) is timed by CUDA-graph replay over rotating
input sets; L1 and L2 are also timed per kernel (profiler) and set against their own floor: the MXFP4
bytes of the experts hit (codes + E8M0 scales) over the measured copy bandwidth. Two routings, as in
producer_split_k.py: one token per row (a rank of the Kimi K3 block at decode: 2 of 16 slots local)
and the producer benchmark's 8 global tokens per row.

    PYTHONPATH=. python3 bench/routed_regs.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.kernel_breakdown import kernel_times_us  # noqa: E402
from bench.producer import (  # noqa: E402
    DT,
    GLOBAL_EXPERTS,
    INTER,
    LATENT,
    LOCAL_EXPERTS,
    TOP_K,
    Case,
    make_rms_weight,
    make_sets,
    make_shared_weights,
    make_weights,
)
from bench.producer_shared_tiles import one_token_sets  # noqa: E402
from latent_moe_fusion.ops.common.reference_math import routed_experts_math  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import ProducerConfig, pick_config  # noqa: E402

DECODE_M = (1, 8, 32, 128)
L1_BYTES = 2 * INTER * (LATENT // 2 + LATENT // 32)  # per expert: gate + up codes and scales
L2_BYTES = LATENT * (INTER // 2 + INTER // 32)
KERNELS = {"triton": ("l1_kernel", "l2_kernel"), "regs": ("l1_regs_kernel", "l2_regs_kernel")}
ROUTINGS = (("1 token/row", one_token_sets), ("8 tokens/row", make_sets))


@dataclass(frozen=True)
class DecodeCase:
    routing: str
    m: int
    case: Case
    picked: ProducerConfig
    hit: float  # experts hit per input set, mean
    l1_floor_us: float
    l2_floor_us: float
    ref: torch.Tensor  # routed_experts_math of input set 0


def decode_cases(ms: list[int], seed: int, bytes_per_s: float) -> Iterator[DecodeCase]:
    """The routed MXFP4 decode problems the routed benchmarks time, per routing and M: inputs (4 rotating
    sets), the picked config, the experts hit with their L1 / L2 byte floors, and the FP32 reference."""
    gen = torch.Generator().manual_seed(seed)
    weights = make_weights("mxfp4", gen)
    shared_w, rms_w = make_shared_weights(), make_rms_weight()
    for routing, make in ROUTINGS:
        for m in ms:
            case = Case(m, "mxfp4", weights, shared_w, rms_w, make(m, 4, gen))
            hit = case.hit_experts()
            yield DecodeCase(routing, m, case, pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS), hit,
                             hit * L1_BYTES / bytes_per_s * 1e6, hit * L2_BYTES / bytes_per_s * 1e6,
                             routed_experts_math(*case.routed_args(case.sets[0])))


def routed_kernel_us(case: Case, config: ProducerConfig) -> dict[str, float]:
    """Profiler time per kernel of the routed op alone, over the rotating input sets (L2-cold weights, as
    in the CUDA-graph replay)."""
    sets = itertools.cycle(range(len(case.sets)))
    return dict(kernel_times_us(lambda: case.routed_only(next(sets), config), iters=8, top=12))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=list(DECODE_M))
    args = ap.parse_args()
    bw = measure_ceilings()["copy_bytes_per_s"]
    rows = []
    for dc in decode_cases(args.m, 23, bw):
        case = dc.case
        configs = {"triton": replace(dc.picked, routed_regs=False), "regs": replace(dc.picked, routed_regs=True)}
        row = {"routing": dc.routing, "M": dc.m, "bm": dc.picked.bm, "experts_hit": dc.hit,
               "l1_floor_us": dc.l1_floor_us, "l2_floor_us": dc.l2_floor_us}
        for name, cfg in configs.items():
            row[f"{name}_err"] = rel_l2(case.routed_only(0, cfg), dc.ref)
            row[f"{name}_us"] = time_graph_ms(lambda i, c=cfg: case.routed_only(i, c), len(case.sets)) * 1e3
            times = routed_kernel_us(case, cfg)
            l1, l2 = KERNELS[name]
            row[f"{name}_l1_us"] = times.get(l1, float("nan")) + times.get("l1_finish_kernel", 0.0)
            row[f"{name}_l2_us"] = times.get(l2, float("nan"))
        row["speedup"] = row["triton_us"] / row["regs_us"]
        row["regs_l1_x_floor"] = row["regs_l1_us"] / row["l1_floor_us"]
        row["regs_l2_x_floor"] = row["regs_l2_us"] / row["l2_floor_us"]
        row["triton_l1_x_floor"] = row["triton_l1_us"] / row["l1_floor_us"]
        rows.append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    cols = ["routing", "M", "bm", "experts_hit", "triton_us", "regs_us", "speedup", "triton_l1_us", "regs_l1_us",
            "l1_floor_us", "triton_l1_x_floor", "regs_l1_x_floor", "triton_l2_us", "regs_l2_us", "l2_floor_us",
            "regs_l2_x_floor", "triton_err", "regs_err"]
    meta = environment() | {
        "copy_TBps": round(bw / 1e12, 3),
        "config": f"routed MXFP4 experts, {LOCAL_EXPERTS}/{GLOBAL_EXPERTS} local, top-{TOP_K}, L={LATENT}, I={INTER}; "
                  "pick_config tiles, routed_regs off (triton) / on (regs)"}
    write_results("routed_regs", rows, cols, meta, args.out,
                  notes="triton_us / regs_us: the routed op (grouping, L1, L2, combine), CUDA-graph replay over 4 "
                        "rotating input sets, us per call. *_l1_us / *_l2_us: profiler kernel time (triton L1 "
                        "includes its split-K finish at M = 1). Floors: MXFP4 codes + scales of the experts hit, "
                        "once, over the measured copy bandwidth. err: rel. L2 vs routed_experts_math (FP32).")


if __name__ == "__main__":
    main()
