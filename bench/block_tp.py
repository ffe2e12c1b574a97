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
rounds with a barrier before each replay; prefill (M = 4096 TP, 2 x 2048 SP): CUDA events around calls back to
back, alternating rounds. Times are each rank's medians; the table gives the slowest rank's. Floor: the rank's
bytes and FLOPs (bench/block.py block_parts_bytes_and_flops) over the measured copy bandwidth and BF16 rate,
communication not counted (TP decode only; SP and prefill rows give it too, for the rank's own tokens).

    PYTHONPATH=. python3 bench/block_tp.py --out bench/results [--world 2] [--m 8 32 128] [--prefill 4096]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latent_moe_fusion as lmf  # noqa: E402
from bench.block import block_parts_bytes_and_flops, compile_afresh, compiled, floor_us  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    measure_ceilings,
    multi_gpu_arguments,
    rel_l2,
    spawn_on_gpus,
    time_back_to_back_interleaved_ms,
    time_graphs_interleaved_ms,
    write_results,
)
from bench.kernel_breakdown import breakdown_markdown, kernel_times_us  # noqa: E402
from latent_moe_fusion.ops.common.symm_exchange import DEFAULT_METHOD  # noqa: E402

EP_SIZE, SHARED_PER_RANK, SETS, ROUNDS, REPLAYS = 8, 768, 4, 5, 6


def rank_block(rank: int, world: int, sequence_parallel: bool) -> lmf.KimiK3MoEBlock:
    import torch.distributed as dist

    cfg = lmf.KimiK3MoEConfig().replace(shared_intermediate_size=SHARED_PER_RANK * world)
    return lmf.KimiK3MoEBlock(cfg, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel,
                              weight_format="mxfp4", dtype=torch.bfloat16, device=f"cuda:{rank}", seed=0,
                              ep_size=EP_SIZE, ep_rank=rank if sequence_parallel else 0, router_gemm="bf16")


def same_draws(shape: tuple[int, ...], seed: int, rank: int | None = None) -> torch.Tensor:
    """The same random batch on every rank (rank None), or rank's row block of one drawn for all ranks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    return (x if rank is None else x[rank]).to("cuda", torch.bfloat16)


def with_exchange(exchange, setting: str, fn, method: str = DEFAULT_METHOD):
    """fn with the symmetric exchange set to `setting` and `method` for its calls (read by the ops at each call and
    at capture)."""
    def run(*args):
        exchange.setting, exchange.method = setting, method
        return fn(*args)
    return run


def case(rank: int, world: int, form: str, m: int, ceilings: dict[str, float], exchange) -> dict[str, Any]:
    """One (form, M) row on this rank: errors against eager, the pass's report, times and the rank's floor."""
    import torch.distributed as dist

    sp = form == "SP"
    torch.manual_seed(0)
    block = rank_block(rank, world, sp)
    fused, fpass = compiled(block, True)
    variants = {"compiled": compiled(block, False), "compiled+fused": (with_exchange(exchange, "auto", fused), fpass),
                "compiled+fused-kernel": (with_exchange(exchange, "on", fused, "kernel"), None),
                "compiled+fused-copies": (with_exchange(exchange, "on", fused, "copies"), None),
                "compiled+fused-nccl": (with_exchange(exchange, "off", fused), None)}
    local_m = m // world if sp else m
    sets = [same_draws((world, local_m, block.cfg.hidden_size) if sp else (m, block.cfg.hidden_size), 100 + s,
                       rank if sp else None) for s in range(SETS if m <= 128 else 1)]
    ref = block(sets[0])
    row: dict[str, Any] = {"form": form, "M": m, "tokens_per_rank": local_m}
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
    row["rank_floor_us"] = float("nan")  # SP: the shared expert runs on every rank's tokens, not counted there
    if not sp:
        parts = block_parts_bytes_and_flops(block, sets[0]).values()
        row["rank_floor_us"] = floor_us(sum(p[0] for p in parts), sum(p[1] for p in parts), ceilings)
    return row


def worker(rank: int, world: int, port: int, cases: list[tuple[str, int]], out: str) -> None:
    import torch.distributed as dist

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        compile_afresh()
        ceilings = measure_ceilings()
        exchange = lmf.prepare_symmetric_exchange(dist.group.WORLD, max_tokens=max(m for _, m in cases), hidden=7168)
        if exchange is None:
            raise SystemExit("no symmetric workspace on this group (see prepare_symmetric_exchange)")
        rows = []
        for form, m in cases:
            mine = case(rank, world, form, m, ceilings, exchange)
            every = [None] * world
            dist.all_gather_object(every, mine)
            if rank == 0:
                row = dict(every[0])
                for key in ("compiled_us", "compiled+fused_us", "compiled+fused-kernel_us", "compiled+fused-copies_us",
                            "compiled+fused-nccl_us"):
                    row[f"{key[:-3]}_per_rank_us"] = " / ".join(f"{r[key]:.1f}" for r in every)
                    row[key] = max(r[key] for r in every)
                row["fused_vs_compiled"] = row["compiled_us"] / row["compiled+fused_us"]
                row["fused_kernel_vs_compiled"] = row["compiled_us"] / row["compiled+fused-kernel_us"]
                row["fused_copies_vs_compiled"] = row["compiled_us"] / row["compiled+fused-copies_us"]
                row["fused_nccl_vs_compiled"] = row["compiled_us"] / row["compiled+fused-nccl_us"]
                row["fused_x_rank_floor"] = row["compiled+fused_us"] / row["rank_floor_us"]
                row["max_err"] = max(max(r[f"{name}_err"] for name in ("compiled", "compiled+fused",
                                                                        "compiled+fused-kernel", "compiled+fused-copies",
                                                                        "compiled+fused-nccl"))
                                     for r in every)
                rows.append(row)
                print(row, flush=True)
        if rank == 0:
            meta = environment() | {
                "world": world, "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
                "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
                "config": f"Kimi K3, R = {world} GPUs over NCCL (NVLS off) and torch symmetric memory (unicast), each rank one EP8 share (112 of 896 MXFP4 "
                          f"experts) and a {SHARED_PER_RANK}-wide shared-expert slice, router GEMM bf16",
                "timing": "decode: one CUDA graph per variant over 4 rotating inputs, 5 alternating rounds of 6 replays, a "
                          "barrier before each; prefill: CUDA events around 4 calls back to back, 5 alternating rounds; "
                          "the slowest rank's median"}
            kernels = {f"{r['form']} M = {r['M']}, {name} (rank 0)": table for r in rows
                       for name, table in r.pop("kernels", {}).items()}
            if kernels:
                (Path(out) / "block_tp_kernels.md").write_text(
                    "# block_tp: CUDA kernel time per kernel at prefill (profiler, rank 0)\n\n" + breakdown_markdown(kernels))
            write_results("block_tp", rows, ["form", "M", "tokens_per_rank", "compiled_us", "compiled+fused_us",
                                             "fused_vs_compiled", "compiled+fused-kernel_us", "fused_kernel_vs_compiled",
                                             "compiled+fused-copies_us", "fused_copies_vs_compiled",
                                             "compiled+fused-nccl_us", "fused_nccl_vs_compiled",
                                             "rank_floor_us", "fused_x_rank_floor", "compiled_per_rank_us",
                                             "compiled+fused_per_rank_us", "compiled+fused-nccl_per_rank_us",
                                             "max_err", "symm_publishes", "compiled+fused_matched", "timing"],
                          meta, out,
                          notes="rank_floor_us: the rank's own bytes and FLOPs over the measured copy bandwidth and "
                                "BF16 rate, communication not counted (TP rows only). max_err: rel. L2 against eager, "
                                "the worst variant and rank.")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = multi_gpu_arguments()
    ap.add_argument("--m", type=int, nargs="*", default=[8, 32, 128], help="TP decode sizes (tokens on every rank)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096], help="prefill sizes, TP and SP (M tokens in all)")
    args = ap.parse_args()
    cases = [("TP", m) for m in args.m] + [(form, m) for m in args.prefill for form in ("TP", "SP")]
    spawn_on_gpus(worker, args.world, (cases, args.out))


if __name__ == "__main__":
    main()
