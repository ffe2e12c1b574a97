"""The router GEMM at decode sizes: is cuBLAS near its byte floor, or would a GEMV kernel pay?

logits [M, E] FP32 = x [M, H] @ W_gate [E, H]^T with BF16 inputs (Kimi K3: H = 7168, E = 896, a
12.8 MB weight). Compared, each in a CUDA graph over rotating weight copies (cold L2, as in a model
whose other layers evict the router's weight):
- `cublas`: torch.mm(x, w.T, out_dtype=float32), the block's router_gemm="bf16" path;
- `fp32`: the HF reference's x.float() @ w.float().T (router_gemm="fp32"), weight cast included;
- `gemv`: a Triton prototype here (one program per BLOCK_N weight rows, whole K, FP32 accumulation,
  no split: deterministic), a few tile shapes.
Floor: the weight's bytes once over the measured copy bandwidth.

    PYTHONPATH=. python3 bench/router_gemm.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402

HIDDEN, EXPERTS = 7168, 896
GEMV_TILES = ((4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8))  # (BLOCK_N, BLOCK_K, num_warps)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tokens = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tokens[:, None] * K + ks[None, :], mask=(tokens[:, None] < M) & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < N) & (ks[None, :] < K),
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + tokens[:, None] * N + rows[None, :], acc, mask=(tokens[:, None] < M) & (rows[None, :] < N))


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, num_warps: int) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    block_m = max(1, triton.next_power_of_2(m))
    block_k = max(64, min(block_k, 16384 // (block_m * block_n)))  # the [M, N, K] product stays in registers
    out = torch.empty(m, n, device=x.device, dtype=torch.float32)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, m, n, k, BLOCK_M=block_m,
                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    ceilings = measure_ceilings()
    copies = 6  # 6 x 12.8 MB > the 50 MB L2
    ws = [torch.randn(EXPERTS, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN**-0.5 for _ in range(copies)]
    floor_us = ws[0].numel() * ws[0].element_size() / ceilings["copy_bytes_per_s"] * 1e6
    rows = []
    for m in args.m:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        exact = (x.double() @ ws[0].double().T)
        variants = {
            "cublas": lambda w: torch.mm(x, w.T, out_dtype=torch.float32),
            "fp32": lambda w: x.float() @ w.float().T,
        } | {f"gemv_{bn}x{bk}_w{nw}": (lambda w, bn=bn, bk=bk, nw=nw: gemv(x, w, bn, bk, nw))
             for bn, bk, nw in GEMV_TILES}
        for name, fn in variants.items():
            us = time_graph_ms(lambda i, fn=fn: fn(ws[i]), copies) * 1e3
            row = {"M": m, "variant": name, "us": us, "floor_us": floor_us, "x_floor": us / floor_us,
                   "err_vs_fp64": rel_l2(fn(ws[0]), exact)}
            rows.append(row)
            print(row, flush=True)
    meta = environment() | {
        "config": f"router logits, H = {HIDDEN}, E = {EXPERTS}, BF16 weight, FP32 logits",
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "timing": f"CUDA graph over {copies} rotating weight copies (cold L2), median replay",
    }
    write_results("router_gemm", rows, ["M", "variant", "us", "floor_us", "x_floor", "err_vs_fp64"], meta, args.out)


if __name__ == "__main__":
    main()
