"""Fragment exchange and tail over R GPUs of one host: symmetric-memory peer writes against torch.distributed (NCCL).

Per M (the op's output tokens: TP every rank's M, SP the local tokens), every rank, one CUDA graph per variant
replayed in alternating rounds with a barrier before each replay, the slowest rank's median:

- exchange rows: the TP fragment publication (this rank's partial [M, H] -> [R, M, H/R] on every owner), the SP
  publication ([R M, H] -> [M, R, H]) and the TP output all-gather ([M, H/R] -> [M, H]), by symmetric memory
  (`symm`: one Triton launch per exchange; `symm_copies`: torch copies between two workspace barriers) and by
  NCCL (`nccl`: fragment_layouts.py's all-to-all / all-gather);
- tail rows: the unfused tails as the compiled reference block runs them (TP: NCCL all-reduce of the shared
  partial, SP: its reduce-scatter; then y_n @ W_up^T + s) against the fused ones (fragment publication, then
  lmf::latent_tail, TP with its output all-gather), fused with each exchange.

Floors: bytes each rank sends to its peers over the measured peer-write bandwidth (one large copy into a peer's
workspace). The whole block, compiled against compiled + fused with either exchange: bench/block_tp.py.

    PYTHONPATH=. python3 bench/tp.py --out bench/results [--world 2] [--m 1 8 32 128 512 2048 4096]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import latent_moe_fusion as lmf  # noqa: E402
from bench.common import (  # noqa: E402
    environment,
    multi_gpu_arguments,
    spawn_on_gpus,
    time_graphs_interleaved_ms,
    upper_median,
    write_results,
)

HIDDEN, LATENT, ROUNDS, REPLAYS = 7168, 3584, 5, 6


def peer_write_bytes_per_s(exchange, rank: int, world: int) -> float:
    """Bytes per second of one large copy from this rank into the next rank's workspace."""
    peer = (rank + 1) % world
    n = exchange.fragment_bytes // 2
    dst = exchange.view(peer, (n,), torch.uint8)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=exchange.device)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return n / upper_median(times)


def rows_for(m: int, exchange, world: int, rank: int, peer_bw: float) -> list[dict[str, Any]]:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from latent_moe_fusion.ops.common import fragment_layouts as layouts

    name, dev = dist.group.WORLD.group_name, exchange.device
    gen = torch.Generator().manual_seed(1000 + m)  # same draws on every rank
    sets = 2 if m <= 128 else 1

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    s_tp = [draw(m, HIDDEN) for _ in range(sets)]
    s_sp = [draw(world * m, HIDDEN) for _ in range(sets)]
    slices = [draw(m, HIDDEN // world) for _ in range(sets)]
    y_n = [draw(m, LATENT) for _ in range(sets)]
    w_up = draw(HIDDEN, LATENT) / LATENT**0.5

    def with_setting(setting: str, fn, method: str = "kernel"):
        def step(i: int):
            exchange.setting, exchange.method = setting, method  # read by the ops at capture; replays repeat it
            return fn(i)
        return step

    def fused_tail(s_partial: list[torch.Tensor], mode: str):
        def run(i: int):
            ws = layouts.publish_fragments(s_partial[i], mode, name)
            return torch.ops.lmf.latent_tail(y_n[i], w_up, ws, mode, name)
        return run

    def unfused_tp_tail(i: int):
        s = funcol.all_reduce(s_tp[i], "sum", name)
        return y_n[i] @ w_up.t() + funcol.wait_tensor(s)

    def unfused_sp_tail(i: int):
        s = funcol.reduce_scatter_tensor(s_sp[i], "sum", 0, name)
        return y_n[i] @ w_up.t() + funcol.wait_tensor(s)

    # (exchange, bytes each rank sends to its peers)
    tp_bytes, sp_bytes = (world - 1) / world * m * HIDDEN * 2, (world - 1) * m * HIDDEN * 2
    parts = {
        "TP fragments": (lambda i: layouts.publish_fragments(s_tp[i], "hidden_scatter", name), tp_bytes),
        "SP fragments": (lambda i: layouts.publish_fragments(s_sp[i], "token_publish", name), sp_bytes),
        "TP output all-gather": (lambda i: layouts.gather_columns(slices[i], name), tp_bytes),
    }
    rows = []
    for part, (fn, sent) in parts.items():
        times = time_graphs_interleaved_ms({"symm": with_setting("on", fn), "copies": with_setting("on", fn, "copies"),
                                            "nccl": with_setting("off", fn)},
                                           sets, ROUNDS, REPLAYS, before_each=dist.barrier)
        rows.append({"part": part, "M": m, "symm_us": times["symm"] * 1e3, "symm_copies_us": times["copies"] * 1e3,
                     "nccl_us": times["nccl"] * 1e3, "floor_us": sent / peer_bw * 1e6})
    for part, fused, unfused in (("TP tail", fused_tail(s_tp, "hidden_scatter"), unfused_tp_tail),
                                 ("SP tail", fused_tail(s_sp, "token_publish"), unfused_sp_tail)):
        times = time_graphs_interleaved_ms({"unfused": with_setting("off", unfused),
                                            "fused_symm": with_setting("on", fused),
                                            "fused_copies": with_setting("on", fused, "copies"),
                                            "fused_nccl": with_setting("off", fused)},
                                           sets, ROUNDS, REPLAYS, before_each=dist.barrier)
        rows.append({"part": part, "M": m, "symm_us": times["fused_symm"] * 1e3,
                     "symm_copies_us": times["fused_copies"] * 1e3, "nccl_us": times["fused_nccl"] * 1e3,
                     "unfused_us": times["unfused"] * 1e3})
    exchange.setting, exchange.method = "auto", "kernel"
    return rows


def worker(rank: int, world: int, port: int, ms: list[int], out: str) -> None:
    import torch.distributed as dist

    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        exchange = lmf.prepare_symmetric_exchange(dist.group.WORLD, max_tokens=max(ms), hidden=HIDDEN)
        if exchange is None:
            raise SystemExit("no symmetric workspace on this group (see prepare_symmetric_exchange)")
        peer_bw = peer_write_bytes_per_s(exchange, rank, world)
        rows = []
        for m in ms:
            mine = rows_for(m, exchange, world, rank, peer_bw)
            every = [None] * world
            dist.all_gather_object(every, mine)
            for i, row in enumerate(mine):
                row = dict(row)
                for key in ("symm_us", "symm_copies_us", "nccl_us", "unfused_us"):
                    if key in row:
                        row[key] = max(r[i][key] for r in every)  # the slowest rank
                row["symm_vs_nccl"] = row["nccl_us"] / row["symm_us"]
                if "unfused_us" in row:
                    row["fused_symm_vs_unfused"] = row["unfused_us"] / row["symm_us"]
                    row["fused_nccl_vs_unfused"] = row["unfused_us"] / row["nccl_us"]
                else:
                    row["symm_x_floor"] = row["symm_us"] / row["floor_us"]
                rows.append(row)
                if rank == 0:
                    print(row, flush=True)
        bws = [None] * world
        dist.all_gather_object(bws, peer_bw)
        if rank == 0:
            meta = environment() | {
                "world": world, "peer_write_GBps": min(bws) / 1e9,
                "config": f"H = {HIDDEN}, L = {LATENT}, bf16; R = {world} GPUs over NCCL (NVLS off) and torch symmetric "
                          "memory (unicast peer writes, no multicast)",
                "timing": f"one CUDA graph per variant ({2} rotating input sets up to M = 128, 1 beyond), {ROUNDS} "
                          f"alternating rounds of {REPLAYS} replays, a barrier before each; the slowest rank's median"}
            write_results("tp", rows, ["part", "M", "symm_us", "symm_copies_us", "nccl_us", "symm_vs_nccl", "floor_us",
                                       "symm_x_floor",
                                       "unfused_us", "fused_symm_vs_unfused", "fused_nccl_vs_unfused"], meta, out,
                          notes="floor_us: the bytes a rank sends to its peers ((R-1)/R M H 2 for TP, (R-1) M H 2 for "
                                "SP, whose M is the local tokens), over the measured peer-write bandwidth. Tails: "
                                "symm_us / symm_copies_us / nccl_us are the fused tail (fragment publication + "
                                "lmf::latent_tail, TP with its output all-gather) with each exchange, unfused_us the "
                                "NCCL all-reduce (TP) or reduce-scatter (SP) + y_n @ W_up^T + s.")
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = multi_gpu_arguments()
    ap.add_argument("--m", type=int, nargs="*", default=[1, 8, 32, 128, 512, 2048, 4096])
    args = ap.parse_args()
    spawn_on_gpus(worker, args.world, (args.m, args.out))


if __name__ == "__main__":
    main()
