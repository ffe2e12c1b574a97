"""CuTe DSL tail vs the Triton tail, side by side on one H200, and the per-bucket backend choice.

out[M, N] = round(fp32(A[M, K] @ W[N, K]^T) + sum_r fp32(F[r, M, N])), K = 3584, N = 7168. Both fused
kernels (and, for context, the unfused torch tail) run on the same rotating input sets, each set
with its own W so that consecutive calls are L2-cold, replayed from one CUDA graph per kernel (GPU
time only; `launch_us` is the CuTe launcher's host time per eager call, measured separately).
Correctness of both against a float64 reference on poisoned outputs is recorded in every row.

The choice table (tail_cute_choice.json) gives a bucket to cute only where cute is at least
CHOICE_MARGIN faster than Triton in every measured row of that bucket; unmeasured buckets stay Triton.
With --install-choice the run also writes it into the table the package ships and the op reads
(latent_moe_fusion/ops/tail/cute/tail_choice.json; `make bench` does).

    PYTHONPATH=. python3 bench/tail_cute.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    environment,
    measure_ceilings,
    rel_l2,
    sets_to_flush_l2,
    time_graph_ms,
    write_results,
)
from latent_moe_fusion.ops.tail.cute import tail_runtime  # noqa: E402
from latent_moe_fusion.ops.tail.cute.tail_backend import DEFAULT_CHOICE  # noqa: E402
from latent_moe_fusion.ops.tail.cute.tail_configs import TABLE, bucket_bound, pick_config  # noqa: E402

K, N = 3584, 7168
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)  # every decode bucket measured
R_VALUES = (1, 8)
DTYPE = torch.bfloat16
CHOICE_MARGIN = 0.03  # cute must be >= 3% faster than Triton (above run-to-run noise) to take a bucket

try:
    from latent_moe_fusion.ops.common.tail_gemm.tail_launch import tail_fused as triton_tail

    TRITON_ERROR = None
except Exception as exc:  # the Triton tail is another issue's work; compare against cuBLAS if absent
    triton_tail, TRITON_ERROR = None, f"{type(exc).__name__}: {exc}"


def unfused(a: torch.Tensor, w: torch.Tensor, f: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    s = torch.sum(f, dim=0, dtype=torch.float32)
    return out.copy_(s.add_(torch.mm(a, w.t())))


def cute(a, w, f, out):
    return tail_runtime.tail_cute_fused(a, w, f, out=out)


def triton(a, w, f, out):
    return triton_tail(a, w, f, out=out)


class Inputs:
    def __init__(self, m: int, r: int):
        per_set = (N * K + m * K + r * m * N + m * N) * 2
        self.num = sets_to_flush_l2(per_set, minimum=2, maximum=8)
        self.w = [torch.randn(N, K, device="cuda", dtype=DTYPE) / K**0.5 for _ in range(self.num)]
        self.a = [torch.randn(m, K, device="cuda", dtype=DTYPE) for _ in range(self.num)]
        self.f = [torch.randn(r, m, N, device="cuda", dtype=DTYPE) for _ in range(self.num)]
        self.out = [torch.empty(m, N, device="cuda", dtype=DTYPE) for _ in range(self.num)]

    def reference(self) -> torch.Tensor:
        acc = self.a[0].double() @ self.w[0].double().t()
        for r in range(self.f[0].shape[0]):
            acc += self.f[0][r].double()
        return acc


def tail_floor_us(m: int, r: int, ceilings: dict[str, float]) -> float:
    """W, A, the fragments and out once over the copy bandwidth, or the FLOPs over the matmul rate."""
    nbytes = (N * K + m * K + r * m * N + m * N) * 2
    return 1e6 * max(nbytes / ceilings["copy_bytes_per_s"], 2 * m * N * K / ceilings["bf16_flop_per_s"])


def cases(ms: list[int], rs: list[int], ceilings: dict[str, float]) -> Iterator[tuple[int, int, Inputs, torch.Tensor, float]]:
    """(M, R, fresh inputs, their float64 reference, the floor in us) for every R, then M."""
    for r in rs:
        for m in ms:
            inputs = Inputs(m, r)
            yield m, r, inputs, inputs.reference(), tail_floor_us(m, r, ceilings)


def checked_error(fn, inputs: Inputs, ref: torch.Tensor) -> float:
    out = inputs.out[0].fill_(float("nan"))
    fn(inputs.a[0], inputs.w[0], inputs.f[0], out)
    torch.cuda.synchronize()
    return float("nan") if out.isnan().any() else rel_l2(out, ref)


def graph_us(fn, inputs: Inputs) -> float:
    return 1e3 * time_graph_ms(lambda i: fn(inputs.a[i], inputs.w[i], inputs.f[i], inputs.out[i]), inputs.num)


def launch_us(inputs: Inputs, calls: int = 50) -> float:
    """Host microseconds per eager CuTe launch (the GPU may lag behind; only the CPU side is timed)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        cute(inputs.a[0], inputs.w[0], inputs.f[0], inputs.out[0])
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return 1e6 * host


def choose(rows: list[dict]) -> dict[str, str]:
    """{bucket bound: 'cute' | 'triton'} over the measured rows (buckets without rows stay Triton)."""
    by_bucket: dict[int, list[dict]] = {}
    for row in rows:
        by_bucket.setdefault(bucket_bound(row["M"]), []).append(row)
    choice = {}
    for bound, _ in TABLE:
        sel = by_bucket.get(bound, [])
        wins = sel and all(
            row["cute_err_ok"] and row["cute_us"] <= (1 - CHOICE_MARGIN) * row["triton_us"] for row in sel
        )
        choice[str(bound)] = "cute" if wins else "triton"
    return choice


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    parser.add_argument("--r", type=int, nargs="*", default=list(R_VALUES))
    parser.add_argument("--install-choice", action="store_true",
                        help="also write the choice into the table the package ships (ops/tail/cute/tail_choice.json)")
    args = parser.parse_args()
    if triton_tail is None:
        print(f"Triton tail unavailable ({TRITON_ERROR}); comparing against the unfused cuBLAS tail", flush=True)

    torch.manual_seed(0)
    meta = environment()
    ceil = measure_ceilings()
    meta.update({k: f"{v:.4g}" for k, v in ceil.items()}, K=K, N=N, dtype="bfloat16", timing="CUDA graph replay")
    try:
        import importlib.metadata

        meta["nvidia_cutlass_dsl"] = importlib.metadata.version("nvidia-cutlass-dsl")
    except Exception:
        pass
    compile_s = {}
    for r in args.r:
        for cfg in dict.fromkeys(pick_config(m) for m in args.m):
            start = time.perf_counter()
            tail_runtime.warmup(m_values=[m for m in args.m if pick_config(m) == cfg], num_frags=[r])
            compile_s[f"{cfg.label()}/R{r}"] = round(time.perf_counter() - start, 2)
            print(f"compiled+loaded {cfg.label()} R={r} in {compile_s[f'{cfg.label()}/R{r}']} s", flush=True)
    meta["cute_compile_s"] = compile_s

    rows = []
    for m, r, inputs, ref, floor in cases(args.m, args.r, ceil):
        row = {"M": m, "R": r, "cute_config": pick_config(m).label(), "floor_us": floor}
        row["cute_err"] = checked_error(cute, inputs, ref)
        row["cute_err_ok"] = bool(row["cute_err"] < 6e-3)
        first = inputs.out[0].clone()
        cute(inputs.a[0], inputs.w[0], inputs.f[0], inputs.out[0])
        row["cute_deterministic"] = bool(torch.equal(first, inputs.out[0]))
        row["cute_us"] = graph_us(cute, inputs)
        row["launch_us"] = launch_us(inputs)
        if triton_tail is not None:
            row["triton_err"] = checked_error(triton, inputs, ref)
            row["triton_us"] = graph_us(triton, inputs)
        else:
            row["triton_us"] = graph_us(unfused, inputs)
        row["unfused_us"] = graph_us(unfused, inputs)
        row["cute_vs_triton"] = row["triton_us"] / row["cute_us"]
        row["cute_x_floor"] = row["cute_us"] / floor
        rows.append(row)
        print(f"M={m:5d} R={r} cute {row['cute_us']:8.2f} us  triton {row['triton_us']:8.2f} us  "
              f"unfused {row['unfused_us']:8.2f}  floor {floor:7.2f}  x{row['cute_vs_triton']:.2f}  "
              f"err {row['cute_err']:.2e} launch {row['launch_us']:.1f} us", flush=True)

    choice = choose(rows)
    meta["comparison"] = "triton tail_fused" if triton_tail is not None else f"unfused cuBLAS ({TRITON_ERROR})"
    columns = ["M", "R", "cute_config", "cute_us", "triton_us", "unfused_us", "floor_us", "cute_vs_triton",
               "cute_x_floor", "cute_err", "triton_err", "cute_deterministic", "launch_us"]
    notes = (f"Choice (cute only where >= {CHOICE_MARGIN:.0%} faster than Triton in every measured row of the "
             f"bucket): {choice}")
    write_results("tail_cute", rows, columns, meta, args.out, notes=notes)
    out_dir = Path(args.out)
    table = json.dumps(
        {"meta": {"source": "bench/tail_cute.py", "device": meta.get("device"), "date": meta.get("date"),
                  "rule": f"cute where >= {CHOICE_MARGIN:.0%} faster than Triton in every measured row"},
         "choice": choice}, indent=2) + "\n"
    (out_dir / "tail_cute_choice.json").write_text(table)
    if args.install_choice:  # the table the package ships and the op reads
        DEFAULT_CHOICE.write_text(table)
        print(f"installed the choice into {DEFAULT_CHOICE}")
    print(notes)
    print(f"{'M':>5} {'R':>2} {'cute us':>9} {'triton us':>9} {'x':>5} {'floor':>7}")
    for row in rows:
        print(f"{row['M']:5d} {row['R']:2d} {row['cute_us']:9.2f} {row['triton_us']:9.2f} "
              f"{row['cute_vs_triton']:5.2f} {row['floor_us']:7.2f}")


if __name__ == "__main__":
    main()
