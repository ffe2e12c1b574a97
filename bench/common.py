"""Shared benchmark plumbing: environment record, measured ceilings, timing, result files.

Every benchmark states the device, versions, shape and the floor of each number: bytes moved once
over the measured copy bandwidth, FLOPs over the measured BF16 matmul rate (docs/design.md, section 4).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
L2_FLUSH_BYTES = 256 * 1024 * 1024  # rotate inputs over more than the 50 MB L2


def environment() -> dict[str, Any]:
    import triton

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        # Host-bound figures (prefill outside graphs, M = 1 decode) differ by ~10 % between the machines
        # one GPU model is lent on: record which host ran them.
        "host": platform.node(),
        "host_cpu": _cpu_model(),
        # Whether the CuTe DSL tail could run (it is the tail's backend where installed and measured faster).
        "cute_dsl": _cute_dsl_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
    else:
        info["device"] = "cpu"
    return info


def _cute_dsl_version() -> str:
    from importlib import metadata, util

    try:
        if util.find_spec("cutlass") is not None:
            return metadata.version("nvidia-cutlass-dsl")
    except (ImportError, ValueError, metadata.PackageNotFoundError):
        pass
    return "absent (Triton tail)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _event_ms(fn: Callable[[], Any]) -> float:
    """Milliseconds of one fn() between two CUDA events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def upper_median(values: Sequence[float]) -> float:
    """The middle value of the sorted samples (the upper of the two middle ones for an even count): always a
    measured sample, never an average of two."""
    return sorted(values)[len(values) // 2]


def time_ms(fn: Callable[[], Any], warmup: int = 10, iters: int = 50) -> float:
    """Median milliseconds of fn() with CUDA events around each call (warm, not graph-captured)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return upper_median([_event_ms(fn) for _ in range(iters)])


def time_interleaved_ms(fns: dict[str, Callable[[], Any]], rounds: int = 5, iters: int = 4) -> dict[str, float]:
    """Median ms per call of each fn, timed in alternating rounds (each round: `iters` calls of every fn
    in turn, CUDA events around each), so that clock and thermal drift during the run hits all of them
    alike. For runs too long for a CUDA graph (prefill)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name] += [_event_ms(fn) for _ in range(iters)]
    return {name: upper_median(v) for name, v in samples.items()}


def time_back_to_back_interleaved_ms(fns: dict[str, Callable[[], Any]], rounds: int = 5, iters: int = 4,
                                     before_each: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median ms per call of each fn, `iters` calls back to back between two CUDA events (no host sync between
    them), in alternating rounds. The host launches the next call while the GPU runs the last, as it does
    with a model's layers, so its launch time counts only where it exceeds the GPU's (prefill, no graph; a
    synchronised single call instead counts all the host time before the first launch, and measured ~5 %
    apart for the same graph in one process). before_each: called before each sample (a barrier across ranks)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before_each is not None:
                before_each()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / iters)
    return {name: upper_median(v) for name, v in samples.items()}


def host_us(fn: Callable[[], Any], calls: int = 60) -> tuple[float, float]:
    """(median, minimum) host microseconds of one call from an idle GPU (synchronised before) to its return;
    the minimum is the call's own cost, the median adds this host's noise (tens of us between runs)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times), min(times)


def time_graph_ms(step: Callable[[int], Any], num_sets: int, replays: int = 20, warmup: int = 3) -> float:
    """Median ms per call of step(i) over rotating input sets i, replayed from one CUDA graph.

    The graph holds one call per input set (so consecutive calls read different, L2-cold data);
    the figure is the graph's replay time divided by num_sets.
    """
    graph = capture_graph(step, num_sets, warmup)
    return upper_median([replay_ms(graph) / num_sets for _ in range(replays)])


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    """Milliseconds of one replay (CUDA events around it, synchronised)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def capture_graph(step: Callable[[int], Any], num_sets: int, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """One CUDA graph holding step(i) for every input set i (compiled / autotuned outside capture first)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(num_sets):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # The warm-up's freed blocks stay cached on `stream`, which nothing uses again, and the graph takes its own pool:
    # hand them back first, or a prefill step's buffers (tens of GB at M = 32768) are held twice during capture.
    torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_sets):
            step(i)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graphs_interleaved_ms(steps: dict[str, Callable[[int], Any]], num_sets: int, rounds: int = 5,
                               replays: int = 6, before_each: Callable[[], Any] | None = None) -> dict[str, float]:
    """time_graph_ms for several variants at once: one graph each, replayed in alternating rounds (each round
    `replays` replays of every graph in turn), so that clock, thermal and L2 drift hits every variant alike.
    Each round replays the variants in another order (a fixed shuffle per round): on the H200 the graph replayed
    after a lighter one ran 3-5 % faster (power headroom; docs/design/measuring.md), so a fixed order, or a
    rotation of it (the same neighbours), favoured the variant after the lightest.
    Median ms per call (replay time / num_sets) of each. before_each: called before each replay (a barrier
    across ranks, whose graphs' collectives must meet)."""
    graphs = {name: capture_graph(step, num_sets) for name, step in steps.items()}
    samples: dict[str, list[float]] = {name: [] for name in steps}
    orders = random.Random(0)
    for _ in range(rounds):
        names = list(graphs)
        orders.shuffle(names)
        for name in names:
            graph = graphs[name]
            for _ in range(replays):
                if before_each is not None:
                    before_each()
                samples[name].append(replay_ms(graph) / num_sets)
    return {name: upper_median(v) for name, v in samples.items()}


@contextlib.contextmanager
def env_applied(env: dict[str, str]):
    """Environment variables set for the duration (the library's operator switches are read per call)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def knobs_applied(knobs: dict[str, Any]):
    """Knobs set for the duration: latent_moe_fusion.tuning override fields (e.g. mxfp4_ring) and operator
    environment variables (LMF_* names, e.g. LMF_ROUTED_FP8). The ops read both when they run, so one compile
    serves every setting (each CUDA graph keeps what it captured). A bad value raises on entry."""
    from latent_moe_fusion import tuning

    env = {k: str(v) for k, v in knobs.items() if k.startswith("LMF_")}
    overrides = {k: v for k, v in knobs.items() if not k.startswith("LMF_")}
    with env_applied(env), tuning.overrides(**overrides):
        yield


def parse_knobs(specs: Sequence[str], what: str = "--knobs") -> dict[str, str]:
    """KNOB=VALUE command-line settings as a dict for knobs_applied (text values: the overrides take them)."""
    knobs = {}
    for spec in specs:
        knob, sep, value = spec.partition("=")
        if not sep or not knob:
            raise SystemExit(f"{what} {spec!r}: expected KNOB=VALUE (a tuning override field or an LMF_ variable)")
        knobs[knob] = value
    return knobs


def sets_to_flush_l2(bytes_per_set: int, minimum: int = 2, maximum: int = 64) -> int:
    return max(minimum, min(maximum, -(-L2_FLUSH_BYTES // max(bytes_per_set, 1))))


def measure_ceilings() -> dict[str, float]:
    """Measured copy bandwidth (bytes read + written per s) and BF16 matmul rate (FLOP/s)."""
    n = 1 << 30
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=5, iters=20)
    copy_bw = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    k = 8192
    a = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=5, iters=20)
    return {"copy_bytes_per_s": copy_bw, "bf16_flop_per_s": 2 * k**3 / (ms * 1e-3)}


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-300))


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(
    name: str,
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    meta: dict[str, Any],
    out_dir: Path | str = RESULTS_DIR,
    notes: str = "",
) -> tuple[Path, Path]:
    """Write <name>.json (meta + rows) and <name>.md (meta header + table) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    md_path = out_dir / f"{name}.md"
    json_path.write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2, default=str) + "\n")
    header = "\n".join(f"- {k}: {v}" for k, v in meta.items())
    md_path.write_text(f"# {name}\n\n{header}\n\n{markdown_table(rows, columns)}\n" + (f"\n{notes}\n" if notes else ""))
    return json_path, md_path


def multi_gpu_arguments(description: str | None = None):
    """An argument parser with the multi-GPU benchmarks' --out (results folder) and --world (GPUs)."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--world", type=int, default=2, help="GPUs of this host, one rank each")
    return ap


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world, local rank) where torchrun (or a launcher that sets its variables) started this process,
    else None."""
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def launch_on_gpus(worker: Callable[..., Any], world: int, args: tuple) -> None:
    """worker(rank, world, port, *args) once per GPU of this host: in this process where torchrun started it
    (`torchrun --nproc-per-node R script.py --world R`; port None: torchrun's MASTER_ADDR / MASTER_PORT), else in R
    processes spawned here (spawn_on_gpus). One host only: the exchanges move fragments over NVLink peers."""
    started = torchrun_rank()
    if started is None:
        spawn_on_gpus(worker, world, args)
        return
    rank, launched, _ = started
    if launched != world:
        raise SystemExit(f"--world {world}, but torchrun started {launched} processes: pass --world {launched} or "
                         f"--nproc-per-node {world}")
    if int(os.environ.get("LOCAL_WORLD_SIZE", launched)) != launched:
        raise SystemExit(f"torchrun spans several hosts ({os.environ.get('LOCAL_WORLD_SIZE')} of {launched} "
                         "processes on this one): run on one host, whose GPUs are NVLink peers")
    worker(rank, world, None, *args)


def init_gpu_rank(rank: int, world: int, port: int | None) -> torch.device:
    """A worker's NCCL process group on its GPU (LOCAL_RANK under torchrun, else cuda:rank); rendezvous on a local
    port, or (port None) where the launcher's MASTER_ADDR / MASTER_PORT say."""
    import torch.distributed as dist

    if port is not None:
        os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    started = torchrun_rank()
    device = torch.device("cuda", started[2] if started is not None else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    return device


def spawn_on_gpus(worker: Callable[..., Any], world: int, args: tuple) -> None:
    """worker(rank, world, port, *args) in one process per GPU (rank r on cuda:r), a free local port for the
    process group's rendezvous."""
    import socket

    if torch.cuda.device_count() < world:
        raise SystemExit(f"needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(world, port, *args), nprocs=world, join=True)
