"""How far an FP8 route for the routed MXFP4 GEMMs would move the numbers (CPU, no kernel): the question behind
producer_notes.md run 17's FP8 lever.

An e2m1 code placed in e4m3 bits is exact (the code times 2^-6), but the wgmma then needs the activations in FP8
too. The exact-looking form splits each bf16 activation a (times a power of two per token, so that the token's
largest |a| sits at the top of e4m3's range) into a_hi = e4m3(a) and a_lo = e4m3(a - a_hi): two FP8 MMAs per
32-wide scale block, the block's FP32 partial times its E8M0 scale, FP32 sums across blocks. This script
measures, on the Kimi K3 latent sizes (L1: 6144 x 3584 codes per expert, K = 3584):

- split_inexact: the share of activations with a_hi + a_lo != a (bf16 has 8 significant bits, the two parts 4
  each, and small values fall below e4m3's subnormals);
- rel_l2 against the float64 product, for the bf16 path the library runs (exact products, FP32 sums) and the
  FP8 split with exact FP32 block sums, and with block sums rounded to 14 mantissa bits (Hopper's FP8 MMA keeps
  about that many in its accumulator, per DeepSeek-V3's report; a model, not a measurement of the hardware).

    python3 bench/fp8_split_numerics.py --out bench/results [--tokens 16] [--outliers 0 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, rel_l2, write_results  # noqa: E402
from latent_moe_fusion.ops.common.mxfp4 import BLOCK, dequantize_mxfp4, quantize_mxfp4  # noqa: E402

E4M3_MAX = 448.0


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to float8_e4m3fn (saturating at +-448) and back to float64."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)


def split_activations(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [T, K] (bf16 values) -> (a_hi, a_lo, per-token power-of-two factor) with a * f ~= a_hi + a_lo."""
    a = a.to(torch.float64)
    top = a.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    f = torch.exp2(torch.floor(torch.log2(E4M3_MAX / top)))
    hi = to_e4m3(a * f)
    lo = to_e4m3(a * f - hi)
    return hi, lo, f


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded to `bits` mantissa bits (a model of a narrower accumulator)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2.0**bits) / 2.0**bits, e)


def block_products(codes: torch.Tensor, scales: torch.Tensor, a_parts: list[torch.Tensor], f: torch.Tensor,
                   accumulator_bits: int | None) -> torch.Tensor:
    """sum over 32-k blocks of scale * (codes @ sum(parts)) per block, in float64 with optional rounding of each
    block's partial sum; codes [N, K] (e2m1 values), scales [N, K/32] (powers of two), parts [T, K]."""
    n, k = codes.shape
    out = torch.zeros(n, a_parts[0].shape[0], dtype=torch.float64)
    for b in range(k // BLOCK):
        sl = slice(b * BLOCK, (b + 1) * BLOCK)
        part = sum(codes[:, sl] @ p[:, sl].T for p in a_parts)
        if accumulator_bits is not None:
            part = round_mantissa(part, accumulator_bits)
        out += scales[:, b : b + 1] * part
    return out / f.T


def measure(n_rows: int, k: int, tokens: int, outlier_gain: float, gen: torch.Generator) -> dict:
    """One case: random MXFP4 weights [n_rows, k], bf16 activations [tokens, k] (1 % of channels times
    outlier_gain, 0: none); the errors of each route against the float64 product."""
    w = torch.randn(n_rows, k, generator=gen) * 0.02
    packed, scales = quantize_mxfp4(w)
    w_deq = dequantize_mxfp4(packed, scales, torch.float64)
    scale_values = torch.exp2(scales.to(torch.float64) - 127)
    codes = w_deq / scale_values.repeat_interleave(BLOCK, dim=1)
    a = torch.randn(tokens, k, generator=gen)
    if outlier_gain:
        hot = torch.rand(tokens, k, generator=gen) < 0.01
        a = torch.where(hot, a * outlier_gain, a)
    a = a.to(torch.bfloat16)
    ref = w_deq @ a.to(torch.float64).T
    bf16_path = (w_deq.float() @ a.float().T).double()  # exact products, FP32 sums (the library's kernels)
    hi, lo, f = split_activations(a)
    return {"outlier_gain": outlier_gain, "tokens": tokens, "rows": n_rows, "K": k,
            "split_inexact": float(((hi + lo) / f != a.to(torch.float64)).double().mean()),
            "bf16_output_rounding_rel_l2": rel_l2(ref.to(torch.bfloat16).double(), ref),
            "bf16_path_rel_l2": rel_l2(bf16_path, ref),
            "fp8_split_rel_l2": rel_l2(block_products(codes, scale_values, [hi, lo], f, None), ref),
            "fp8_split_acc14_rel_l2": rel_l2(block_products(codes, scale_values, [hi, lo], f, 14), ref),
            "fp8_hi_only_acc14_rel_l2": rel_l2(block_products(codes, scale_values, [hi], f, 14), ref)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--rows", type=int, default=512, help="weight rows (of L1's 6144 per expert)")
    ap.add_argument("--k", type=int, default=3584, help="K (L1: the latent width)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--outliers", type=float, nargs="+", default=[0.0, 8.0, 64.0],
                    help="activation outlier gains: 1 %% of each token's channels scaled by this (0: none)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(26)
    rows = [measure(args.rows, args.k, args.tokens, gain, gen) for gain in args.outliers]
    for r in rows:
        print(r, flush=True)
    meta = environment() | {
        "model": "weights N(0, 0.02) quantised to MXFP4; activations N(0, 1) in bf16, 1 % of channels scaled by the "
                 "outlier gain; per-token power-of-two factor so the largest |a| meets e4m3's 448"}
    write_results("fp8_split_numerics", rows, list(rows[0]), meta, args.out,
                  notes="`bf16_path`: what the library computes (exact products, FP32 sums). `fp8_split`: a_hi + a_lo, "
                        "exact block sums; `_acc14`: block sums rounded to 14 mantissa bits (a model of Hopper's FP8 "
                        "accumulator); `fp8_hi_only`: one FP8 part only. `bf16_output_rounding`: the float64 product "
                        "rounded to bf16 once, for scale (the op's outputs are bf16).")


if __name__ == "__main__":
    main()
