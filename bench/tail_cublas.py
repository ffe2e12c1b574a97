"""Why the tail is not one cuBLAS call: torch.addmm (GEMM + epilogue add of the one fragment) against
the tail `lmf::latent_tail` picks, for speed and for rounding.

out[M, N] = round(fp32(A[M, K] @ W[N, K]^T) + fp32(F[0, M, N])), K = 3584, N = 7168, R = 1: with one
BF16 fragment this looks like cuBLAS's D = A @ B + C. The op rounds once; `exact_share` is the share
of output elements equal to the float64 result rounded to BF16 once (a single rounding of an
FP32-accurate value gets nearly all of them), and `err` the relative L2 error against float64. addmm
runs with torch's BF16 reduced-precision split-K reduction off. Rotating L2-cold input sets, each
replayed from one CUDA graph.

    PYTHONPATH=. python3 bench/tail_cublas.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, sets_to_flush_l2, time_graph_ms, write_results  # noqa: E402
from latent_moe_fusion.ops import latent_tail  # noqa: E402
from latent_moe_fusion.ops.common.backends import select_backend  # noqa: E402

K, N = 3584, 7168
M_VALUES = (1, 8, 32, 128, 256, 512, 1024, 2048, 4096)
DTYPE = torch.bfloat16


def addmm_tail(a: torch.Tensor, w: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return torch.addmm(f[0], a, w.t())
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved


def measure(m: int, ceil: dict[str, float]) -> dict:
    per_set = (N * K + m * K + 2 * m * N) * 2
    num = sets_to_flush_l2(per_set, minimum=2, maximum=8)
    w = [torch.randn(N, K, device="cuda", dtype=DTYPE) / K**0.5 for _ in range(num)]
    a = [torch.randn(m, K, device="cuda", dtype=DTYPE) for _ in range(num)]
    f = [torch.randn(1, m, N, device="cuda", dtype=DTYPE) for _ in range(num)]
    ref = a[0].double() @ w[0].double().t() + f[0][0].double()
    floor = 1e6 * max(per_set / ceil["copy_bytes_per_s"], 2 * m * N * K / ceil["bf16_flop_per_s"])
    op_backend = select_backend("latent_tail", "cuda", a[0], w[0], f[0], "local", None).name
    row = {"M": m, "op_backend": op_backend, "floor_us": floor}
    tails = {"addmm": lambda i: addmm_tail(a[i], w[i], f[i]),
             "op": lambda i: latent_tail(a[i], w[i], f[i], "local")}
    for name, step in tails.items():
        out = step(0)
        torch.cuda.synchronize()
        row[f"{name}_err"] = float("nan") if out.isnan().any() else rel_l2(out, ref)
        row[f"{name}_exact_share"] = float((out == ref.to(DTYPE)).float().mean())
        row[f"{name}_us"] = 1e3 * time_graph_ms(step, num)
    row["addmm_speedup"] = row["op_us"] / row["addmm_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--m", type=int, nargs="*", default=list(M_VALUES))
    args = parser.parse_args()
    torch.manual_seed(0)
    meta = environment()
    ceil = measure_ceilings()
    meta.update({k: f"{v:.4g}" for k, v in ceil.items()}, K=K, N=N, R=1, dtype="bfloat16",
                timing="CUDA graph replay over rotating L2-cold input sets, median")
    rows = []
    for m in args.m:
        rows.append(measure(m, ceil))
        print(rows[-1], flush=True)
    columns = ["M", "op_backend", "op_us", "addmm_us", "addmm_speedup", "floor_us", "op_err", "addmm_err",
               "op_exact_share", "addmm_exact_share"]
    write_results("tail_cublas", rows, columns, meta, args.out)


if __name__ == "__main__":
    main()
