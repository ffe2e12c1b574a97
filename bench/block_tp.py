"""The Kimi K3 block over R GPUs of one host with NCCL: compiled against compiled + fused, communication included.

`block.py` times one rank alone (R = 1). Here every rank runs its share for real: the shared expert's
tensor-parallel output is all-reduced (TP) or reduce-scattered after an all-gather of the tokens (SP, the
sequence-parallel form), as PyTorch functional collectives over NCCL, which the pass rewrites into the fused
ops' fragment exchange. Each rank does one EP8 rank's routed work (112 of 896 MXFP4 experts) and holds a
768-wide slice of the shared expert (shared_intermediate_size = 768 R), as one rank of TP8/EP8 does. The TP
form replicates the routed branch (the reference block has no EP combine), so its ranks all hold EP share 0
(KimiK3MoEBlock refuses different shares there); SP ranks route their own tokens and hold share `rank`.

The fused block runs its fragment publication and TP output all-gather by symmetric-memory peer writes
(`lmf.prepare_symmetric_exchange`, made once per process; `compiled+fused`: the library's default method within
its measured windows; `compiled+fused-kernel` / `-copies`: the one-launch exchange kernel / torch copies between
workspace barriers at every size) and by NCCL (`compiled+fused-nccl`: the same compile with the exchange switched
off).

Decode (TP, M tokens on every rank): one CUDA graph per variant over rotating inputs, replayed in alternating
rounds with a barrier before each replay; prefill (M = 4096 TP, R x 4096 / R SP): CUDA events around calls back to
back, alternating rounds. Times are each rank's medians; the table gives the slowest rank's (every rank's row is
gathered, each variant's largest median kept).

Floor of a row (FLOOR_RULE): the rank's bytes and FLOPs (bench/block.py block_parts_bytes_and_flops; SP: with the
shared expert over the gathered tokens) over the measured copy bandwidth and BF16 rate, plus the NVLink bytes the
rank must send over the measured peer-write bandwidth (one large copy into the next rank's workspace, the slowest
rank's), the slowest rank's.

R = 2, 4 or 8, spawned here or started by torchrun (one host):

    PYTHONPATH=. python3 bench/block_tp.py --out bench/results [--world 2] [--m 8 32 128] [--prefill 4096]
    PYTHONPATH=. torchrun --nproc-per-node 4 bench/block_tp.py --world 4 --out bench/results
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latent_moe_fusion as lmf  # noqa: E402
from bench.block import block_parts_bytes_and_flops, compile_afresh, compiled, floor_us  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    init_gpu_rank,
    launch_on_gpus,
    measure_ceilings,
    multi_gpu_arguments,
    rel_l2,
    time_back_to_back_interleaved_ms,
    time_graphs_interleaved_ms,
    write_results,
)
from bench.kernel_breakdown import breakdown_markdown, kernel_times_us  # noqa: E402
from bench.tp import peer_write_bytes_per_s  # noqa: E402
from latent_moe_fusion.ops.common.symm_exchange import DEFAULT_METHOD  # noqa: E402

EP_SIZE, SHARED_PER_RANK, SETS, ROUNDS, REPLAYS = 8, 768, 4, 5, 6
WORLDS = (2, 4, 8)  # SP ranks hold EP shares 0 .. R-1 of EP_SIZE; the hidden size splits into R column slices
VARIANTS = ("compiled", "compiled+fused", "compiled+fused-kernel", "compiled+fused-copies", "compiled+fused-nccl")
RATIOS = {"compiled+fused": "fused_vs_compiled", "compiled+fused-kernel": "fused_kernel_vs_compiled",
          "compiled+fused-copies": "fused_copies_vs_compiled", "compiled+fused-nccl": "fused_nccl_vs_compiled"}
COLUMNS = ["form", "M", "tokens_per_rank", "compiled_us", "compiled+fused_us", "fused_vs_compiled",
           "compiled+fused-kernel_us", "fused_kernel_vs_compiled", "compiled+fused-copies_us",
           "fused_copies_vs_compiled", "compiled+fused-nccl_us", "fused_nccl_vs_compiled", "local_floor_us",
           "link_floor_us", "rank_floor_us", "fused_x_rank_floor", "compiled_x_rank_floor", "compiled_per_rank_us",
           "compiled+fused_per_rank_us", "compiled+fused-nccl_per_rank_us", "max_err", "symm_publishes",
           "compiled+fused_matched", "timing"]
FLOOR_RULE = ("rank_floor_us = local_floor_us + link_floor_us, the slowest rank's. local_floor_us: the rank's bytes "
              "and FLOPs (weights it reads once, its tokens' activations; SP with the shared expert over the R "
              "gathered token blocks) over the measured copy bandwidth and BF16 rate. link_floor_us: the NVLink bytes "
              "the rank must send, 2 (R-1)/R M H 2 for both forms (TP: an all-reduce's reduce-scatter and all-gather "
              "halves, which the fused form moves as fragments and output columns; SP: the tokens' all-gather and the "
              "shared output's reduce-scatter, M the tokens of all ranks), over link_GBps, one large copy into the "
              "next rank's symmetric workspace, the slowest rank's. Communication counted in a row with the rest: a "
              "schedule that hides it entirely could go below the floor by at most link_floor_us.")


def results_name(world: int) -> str:
    """R = 2 keeps the name its committed results have; other R get their own files."""
    return "block_tp" if world == 2 else f"block_tp_{world}gpu"


def link_bytes(m: int, hidden: int, world: int, itemsize: int = 2) -> float:
    """NVLink bytes one rank sends per block (FLOOR_RULE), TP and SP alike; m: the tokens of all ranks."""
    return 2 * (world - 1) / world * m * hidden * itemsize


def sp_shared_extra(block: lmf.KimiK3MoEBlock, x: torch.Tensor, world: int) -> tuple[float, float]:
    """(bytes, FLOPs) that an SP rank's shared expert adds over block_parts_bytes_and_flops of its own tokens x: it
    runs on the R gathered token blocks, so the other R-1 blocks are read and multiplied too."""
    hidden, inter_s = block.cfg.hidden_size, block.shared_w2.shape[1]
    others = (world - 1) * x.shape[0]
    return float(others * hidden * x.element_size()), float(2 * others * 3 * hidden * inter_s)


def local_floor_us(block: lmf.KimiK3MoEBlock, x: torch.Tensor, sp: bool, world: int,
                   ceilings: dict[str, float]) -> float:
    parts = list(block_parts_bytes_and_flops(block, x).values())
    if sp:
        parts.append(sp_shared_extra(block, x, world))
    return floor_us(sum(p[0] for p in parts), sum(p[1] for p in parts), ceilings)


def merge_ranks(every: list[dict[str, Any]], link_bytes_per_s: float) -> dict[str, Any]:
    """The table's row from every rank's: each variant's time the slowest rank's median (and every rank's), the
    ratios to compiled, the worst error of any variant and rank, and the floors (FLOOR_RULE)."""
    world = len(every)
    row = dict(every[0])
    for name in VARIANTS:
        row[f"{name}_per_rank_us"] = " / ".join(f"{r[f'{name}_us']:.1f}" for r in every)
        row[f"{name}_us"] = max(r[f"{name}_us"] for r in every)
    for name, ratio in RATIOS.items():
        row[ratio] = row["compiled_us"] / row[f"{name}_us"]
    row["max_err"] = max(r[f"{name}_err"] for r in every for name in VARIANTS)
    row["local_floor_us"] = max(r["local_floor_us"] for r in every)
    row["link_floor_us"] = link_bytes(row["M"], row["hidden"], world) / link_bytes_per_s * 1e6
    row["rank_floor_us"] = row["local_floor_us"] + row["link_floor_us"]
    row["fused_x_rank_floor"] = row["compiled+fused_us"] / row["rank_floor_us"]
    row["compiled_x_rank_floor"] = row["compiled_us"] / row["rank_floor_us"]
    return row


def rank_block(device: torch.device, rank: int, world: int, sequence_parallel: bool) -> lmf.KimiK3MoEBlock:
    import torch.distributed as dist

    cfg = lmf.KimiK3MoEConfig().replace(shared_intermediate_size=SHARED_PER_RANK * world)
    return lmf.KimiK3MoEBlock(cfg, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel,
                              weight_format="mxfp4", dtype=torch.bfloat16, device=device, seed=0,
                              ep_size=EP_SIZE, ep_rank=rank if sequence_parallel else 0, router_gemm="bf16")


def same_draws(shape: tuple[int, ...], seed: int, device: torch.device, rank: int | None = None) -> torch.Tensor:
    """The same random batch on every rank (rank None), or rank's row block of one drawn for all ranks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    return (x if rank is None else x[rank]).to(device, torch.bfloat16)


def with_exchange(exchange, setting: str, fn, method: str = DEFAULT_METHOD):
    """fn with the symmetric exchange set to `setting` and `method` for its calls (read by the ops at each call and
    at capture)."""
    def run(*args):
        exchange.setting, exchange.method = setting, method
        return fn(*args)
    return run


def case(device: torch.device, rank: int, world: int, form: str, m: int, ceilings: dict[str, float],
         exchange) -> dict[str, Any]:
    """One (form, M) row on this rank: errors against eager, the pass's report, times and the rank's local floor."""
    import torch.distributed as dist

    sp = form == "SP"
    torch.manual_seed(0)
    block = rank_block(device, rank, world, sp)
    fused, fpass = compiled(block, True)
    variants = {"compiled": compiled(block, False), "compiled+fused": (with_exchange(exchange, "auto", fused), fpass),
                "compiled+fused-kernel": (with_exchange(exchange, "on", fused, "kernel"), None),
                "compiled+fused-copies": (with_exchange(exchange, "on", fused, "copies"), None),
                "compiled+fused-nccl": (with_exchange(exchange, "off", fused), None)}
    local_m = m // world if sp else m
    hidden = block.cfg.hidden_size
    sets = [same_draws((world, local_m, hidden) if sp else (m, hidden), 100 + s, device, rank if sp else None)
            for s in range(SETS if m <= 128 else 1)]
    ref = block(sets[0])
    row: dict[str, Any] = {"form": form, "M": m, "tokens_per_rank": local_m, "hidden": hidden}
    publishes = exchange.publishes
    for name, (fn, fpass) in variants.items():
        row[f"{name}_err"] = rel_l2(fn(sets[0]), ref)
        if fpass is not None:
            row[f"{name}_matched"] = f"{fpass.report.matched} block, forms {sorted(b.form for b in fpass.report.blocks)}"
    row["symm_publishes"] = exchange.publishes - publishes  # 3 where the default variant's window takes the path
    fns = {name: fn for name, (fn, _) in variants.items()}
    barrier = dist.barrier  # every rank's graphs and calls must meet in their collectives

    def back_to_back() -> dict[str, float]:
        return time_back_to_back_interleaved_ms({name: lambda fn=fn: fn(sets[0]) for name, fn in fns.items()},
                                                ROUNDS, before_each=barrier)

    if m <= 128:
        try:
            times = time_graphs_interleaved_ms({name: lambda i, fn=fn: fn(sets[i]) for name, fn in fns.items()},
                                               len(sets), ROUNDS, REPLAYS, before_each=barrier)
            row["timing"] = "CUDA graph"
        except Exception as exc:  # noqa: BLE001 - record it, time without a graph instead
            row["timing"] = f"no graph ({type(exc).__name__}: {str(exc)[:80]})"
            times = back_to_back()
    else:
        times = back_to_back()
        row["timing"] = "back to back"
    row |= {f"{name}_us": ms * 1e3 for name, ms in times.items()}
    if m > 128:  # where the time goes at prefill (every rank profiles: the collectives must pair up)
        row["kernels"] = {name: kernel_times_us(lambda fn=fn: fn(sets[0]), top=10) for name, fn in fns.items()}
    row["local_floor_us"] = local_floor_us(block, sets[0], sp, world, ceilings)
    return row


def worker(rank: int, world: int, port: int | None, cases: list[tuple[str, int]], out: str) -> None:
    import torch.distributed as dist

    device = init_gpu_rank(rank, world, port)
    try:
        compile_afresh()
        ceilings = measure_ceilings()
        exchange = lmf.prepare_symmetric_exchange(dist.group.WORLD, max_tokens=max(m for _, m in cases), hidden=7168)
        if exchange is None:
            raise SystemExit("no symmetric workspace on this group (see prepare_symmetric_exchange)")
        link_bws = [None] * world
        dist.all_gather_object(link_bws, peer_write_bytes_per_s(exchange, rank, world))
        link_bw = min(link_bws)
        rows = []
        for form, m in cases:
            every = [None] * world
            dist.all_gather_object(every, case(device, rank, world, form, m, ceilings, exchange))
            if rank == 0:
                rows.append(merge_ranks(every, link_bw))
                print({k: v for k, v in rows[-1].items() if k != "kernels"}, flush=True)
        if rank == 0:
            write_world_results(rows, world, ceilings, link_bw, out)
    finally:
        dist.destroy_process_group()


def write_world_results(rows: list[dict[str, Any]], world: int, ceilings: dict[str, float], link_bw: float,
                        out: str) -> None:
    name = results_name(world)
    meta = environment() | {
        "world": world, "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12, "link_GBps": link_bw / 1e9,
        "config": f"Kimi K3, R = {world} GPUs over NCCL (NVLS off) and torch symmetric memory (unicast), each rank one "
                  f"EP8 share (112 of 896 MXFP4 experts) and a {SHARED_PER_RANK}-wide shared-expert slice, router "
                  "GEMM bf16",
        "timing": f"decode: one CUDA graph per variant over {SETS} rotating inputs, {ROUNDS} alternating rounds of "
                  f"{REPLAYS} replays, a barrier before each; prefill: CUDA events around 4 calls back to back, "
                  f"{ROUNDS} alternating rounds; the slowest rank's median",
        "floor": FLOOR_RULE}
    kernels = {f"{r['form']} M = {r['M']}, {variant} (rank 0)": table for r in rows
               for variant, table in r.pop("kernels", {}).items()}
    if kernels:
        (Path(out) / f"{name}_kernels.md").write_text(
            f"# {name}: CUDA kernel time per kernel at prefill (profiler, rank 0)\n\n" + breakdown_markdown(kernels))
    write_results(name, rows, COLUMNS, meta, out,
                  notes="max_err: rel. L2 against eager, the worst variant and rank. Floors: the floor rule above.")


def main() -> None:
    ap = multi_gpu_arguments()
    ap.add_argument("--m", type=int, nargs="*", default=[8, 32, 128], help="TP decode sizes (tokens on every rank)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096], help="prefill sizes, TP and SP (M tokens in all)")
    args = ap.parse_args()
    if args.world not in WORLDS:
        ap.error(f"--world {args.world}: one of {WORLDS} (SP ranks hold EP8 shares; H = 7168 splits R ways)")
    if any(m % args.world for m in args.prefill):
        ap.error(f"--prefill {args.prefill}: each size must split into {args.world} equal SP token blocks")
    cases = [("TP", m) for m in args.m] + [(form, m) for m in args.prefill for form in ("TP", "SP")]
    launch_on_gpus(worker, args.world, (cases, args.out))


if __name__ == "__main__":
    main()
