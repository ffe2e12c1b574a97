"""What W4A8 (FP8 activations in 1 x 128 blocks, MXFP4 weights expanded to e4m3) costs in accuracy on Kimi K3's routed
experts, beside the BF16-activation path, before any kernel exists (ops/routed/w4a8_numerics.py). Runs on the CPU.

Kimi K3's L = 3584, I = 3072, top-16 over 16 experts (every token on all of them: the per-pair numerics are those of
the rank's 112), MXFP4 weights quantised from Gaussian weights, bf16 tokens; per seed: the relative L2 error against
the exact float64 op of the W4A8 form (from its quantised operands, exact sums) and of the BF16 path's numerics
(reference_math: FP32 sums, the SiTU activation rounded to bf16, one final rounding); and how many of the weights'
64-row x 128-k blocks hold E8M0 exponents more than 8 apart (their smaller values round in e4m3).

    PYTHONPATH=. python3 bench/w4a8_numerics.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import RESULTS_DIR, environment, write_results  # noqa: E402
from latent_moe_fusion.kimi_k3_config import KimiK3MoEConfig  # noqa: E402
from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4  # noqa: E402
from latent_moe_fusion.ops.common.reference_math import routed_experts_math  # noqa: E402
from latent_moe_fusion.ops.routed.w4a8_numerics import ACT_BLOCK, WEIGHT_BLOCK_ROWS, routed_experts64  # noqa: E402

CFG = KimiK3MoEConfig()
EXPERTS = CFG.top_k  # every token on all of them
EXPONENT_REACH = 8  # e4m3 holds e2m1 * 2^-d exactly for d <= 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def _wide_blocks(scales: torch.Tensor) -> float:
    """Share of the 64-row x 128-k blocks (the expansion's scale blocks) whose exponents lie more than
    EXPONENT_REACH apart."""
    e, n, kb = scales.shape[0], scales.shape[1], scales.shape[2] * 32 // ACT_BLOCK
    exps = scales.to(torch.int32).reshape(e, n // WEIGHT_BLOCK_ROWS, WEIGHT_BLOCK_ROWS, kb, ACT_BLOCK // 32)
    spread = exps.amax(dim=(2, 4)) - exps.amin(dim=(2, 4))
    return float((spread > EXPONENT_REACH).float().mean())


def _mxfp4_experts(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EXPERTS Gaussian weights [rows, k] / sqrt(k) as MXFP4, one expert at a time (quantising all at once takes
    tens of GB)."""
    parts = [quantize_mxfp4(torch.randn(rows, k) / k**0.5) for _ in range(EXPERTS)]
    return torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])


def measure(seed: int, tokens: int) -> dict:
    torch.manual_seed(seed)
    latent, inter = CFG.latent_size, CFG.moe_intermediate_size
    z = torch.randn(tokens, latent).to(torch.bfloat16)
    p13, s13 = _mxfp4_experts(2 * inter, latent)
    p2, s2 = _mxfp4_experts(latent, inter)
    ids = torch.stack([torch.randperm(EXPERTS) for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, EXPERTS)
    weights /= weights.sum(-1, keepdim=True)
    args = (z, ids, weights, p13, p2, s13, s2, CFG.situ_beta, CFG.situ_linear_beta)
    exact = routed_experts64(*args, w4a8=False)
    w4a8 = routed_experts64(*args, w4a8=True).to(torch.bfloat16)  # the op's output is bf16
    bf16 = routed_experts_math(z, ids, weights, p13, p2, s13, s2, "mxfp4", CFG.situ_beta, CFG.situ_linear_beta)
    return {"seed": seed, "tokens": tokens, "pairs": tokens * EXPERTS, "w4a8_err": _rel(w4a8, exact),
            "bf16_err": _rel(bf16, exact), "w4a8_vs_bf16": _rel(w4a8, exact) / _rel(bf16, exact),
            "wide_weight_blocks": max(_wide_blocks(s13), _wide_blocks(s2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    rows = [measure(seed, args.tokens) for seed in range(args.seeds)]
    for row in rows:
        print(row)
    meta = environment()
    meta["shape"] = (f"Kimi K3 routed experts: L={CFG.latent_size}, I={CFG.moe_intermediate_size}, top-{CFG.top_k} "
                     f"over {EXPERTS} MXFP4 experts (every token on all), {args.tokens} bf16 tokens per seed")
    meta["errors"] = ("relative L2 against the exact float64 op (weights dequantised exactly, nothing rounded); "
                      "w4a8: activations per token in 1x128 e4m3 blocks with FP32 scales, the SiTU activation the "
                      "same from FP32, weights as e4m3 with one scale per 128-wide K block, exact sums, bf16 output; "
                      "bf16: the BF16-activation path's numerics (FP32 sums, SiTU rounded to bf16, bf16 output)")
    meta["wide_weight_blocks"] = (f"share of the weights' 64-row x 128-k blocks whose E8M0 exponents lie more than "
                                  f"{EXPONENT_REACH} apart (W1/W3 or W2, the larger)")
    write_results("w4a8_numerics", rows, ["seed", "tokens", "pairs", "w4a8_err", "bf16_err", "w4a8_vs_bf16",
                                          "wide_weight_blocks"], meta, args.out)


if __name__ == "__main__":
    main()
