"""Run a function in R real processes with a gloo process group, collecting each rank's result.

    results = run_gloo(worker_fn, world_size=2, args=(...))   # list indexed by rank

`backend="nccl"` runs the same on R GPUs of one host instead (rank r on cuda:r; GPU tests only).

`worker_fn(rank, world_size, *args)` runs inside an initialized default group (gloo, CPU) and
returns something picklable. A worker that raises makes run_gloo raise with the traceback.

`preload=("latent_moe_fusion", ...)` starts workers from a forkserver that imported those modules
once per test session (a spawned worker spends ~10 s of CPU importing torch and the package on
2 cores). Modules it preloads keep the environment they were imported with; the parent's current
environment variables are copied into each worker before `worker_fn` runs.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, env: dict | None = None,
           backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    if env is not None:  # a forkserver child starts with the forkserver's environment, not the parent's
        os.environ.clear()
        os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        import latent_moe_fusion  # noqa: F401

        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            queue.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, the parent re-raises
        queue.put((rank, "error", traceback.format_exc()))
    # Gloo workers sometimes abort at interpreter exit; flush the queue and leave hard.
    queue.close()
    queue.join_thread()
    os._exit(0)


def run_gloo(
    fn: Callable, world_size: int, args: tuple = (), timeout: float = 300.0, preload: tuple[str, ...] = (),
    backend: str = "gloo",
) -> list[Any]:
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))  # takes effect when the forkserver first starts
        env = dict(os.environ)
    else:
        ctx = mp.get_context("spawn")
        env = None
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, env, backend))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(f"{backend} worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
