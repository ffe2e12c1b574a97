"""Inputs, float64 reference and floor of the routed experts of one Kimi K3 rank at EP8 (bench/peer_routed.py).

The rank holds experts 0..111 of 896. Each token picks 16 distinct experts of 896 (top-16 of uniform random scores,
weights = the chosen scores normalised to sum 1); ids of the other ranks' experts become -1, as
`localize_ids` makes them in the block (bench/block.py routes random tokens through the block's router, which spreads
them the same way): about 16 * 112 / 896 = 2 local experts per token. Weights: random MXFP4 codes with E8M0 scales
2^-8 .. 2^-5 (as bench/producer.py), so every expert's bytes are distinct and nothing is cached between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latent_moe_fusion.ops import dequantize_mxfp4

GLOBAL_EXPERTS, LOCAL_EXPERTS, TOP_K = 896, 112, 16
LATENT, INTER = 3584, 3072
BETA, LIN_BETA = 4.0, 25.0
MXFP4_BLOCK = 32


@dataclass
class RankInputs:
    z: torch.Tensor  # [M, L] bf16
    ids: torch.Tensor  # [M, 16] int32, local expert ids or -1
    weights: torch.Tensor  # [M, 16] fp32

    def hit_experts(self) -> int:
        return int(torch.unique(self.ids[self.ids >= 0]).numel())

    def assignments(self) -> int:
        return int((self.ids >= 0).sum())


def rank_routing(m: int, gen: torch.Generator, device: torch.device | str,
                 local_experts: int = LOCAL_EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [m, 16] int32: this rank's experts 0..local_experts-1 or -1; weights [m, 16] fp32)."""
    scores = torch.rand(m, GLOBAL_EXPERTS, generator=gen, device=device)
    top_scores, top_ids = scores.topk(TOP_K, dim=1)
    weights = top_scores / top_scores.sum(dim=1, keepdim=True)
    ids = torch.where(top_ids < local_experts, top_ids, -1)
    return ids.to(torch.int32).contiguous(), weights.contiguous()


def rank_inputs(m: int, gen: torch.Generator, device: torch.device | str) -> RankInputs:
    ids, weights = rank_routing(m, gen, device)
    z = torch.randn(m, LATENT, generator=gen, device=device).to(torch.bfloat16)
    return RankInputs(z, ids, weights)


def rank_weights(gen: torch.Generator, device: torch.device | str, num_experts: int = LOCAL_EXPERTS,
                 latent: int = LATENT, inter: int = INTER) -> dict[str, torch.Tensor]:
    """Random MXFP4 w13 [E, 2I, L/2] (+ scales [E, 2I, L/32]) and w2 [E, L, I/2] (+ [E, L, I/32]), our layout."""
    def codes(n: int, k: int) -> torch.Tensor:
        return torch.randint(0, 256, (num_experts, n, k // 2), generator=gen, device=device, dtype=torch.uint8)

    def scales(n: int, k: int) -> torch.Tensor:
        return torch.randint(119, 123, (num_experts, n, k // MXFP4_BLOCK), generator=gen, device=device,
                             dtype=torch.uint8)

    return {"w13": codes(2 * inter, latent), "w13_scale": scales(2 * inter, latent),
            "w2": codes(latent, inter), "w2_scale": scales(latent, inter)}


def expert_bytes(latent: int = LATENT, inter: int = INTER) -> int:
    """MXFP4 bytes of one expert (codes + scales of w13 and w2)."""
    elements = 3 * inter * latent
    return elements // 2 + elements // MXFP4_BLOCK


def floor_terms(inputs: RankInputs, latent: int = LATENT, inter: int = INTER,
                bytes_per_expert: int | None = None) -> tuple[float, float]:
    """(bytes the op must move once, FLOPs): the weights of the experts hit, z read, y written, ids and weights read;
    2 * 3 * I * L FLOPs per (token, local expert) pair."""
    per_expert = expert_bytes(latent, inter) if bytes_per_expert is None else bytes_per_expert
    m = inputs.z.shape[0]
    activations = 2 * m * latent * inputs.z.element_size() + inputs.ids.numel() * (4 + 4)
    return float(inputs.hit_experts() * per_expert + activations), float(2 * inputs.assignments() * 3 * inter * latent)


def floor_us(nbytes: float, flops: float, ceilings: dict[str, float]) -> float:
    """The larger of bytes / measured copy bandwidth and FLOPs / measured BF16 rate, in us."""
    return max(nbytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flop_per_s"]) * 1e6


def routed_float64(inputs: RankInputs, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                   w2_scale: torch.Tensor, beta: float = BETA, lin_beta: float = LIN_BETA) -> torch.Tensor:
    """y [M, L] float64: sum over the local slots of weight * W2[e] @ SiTU(W1[e] z, W3[e] z), nothing rounded (the
    weights dequantised exactly, z's bf16 values), expert by expert (host syncs: a reference, not a timed path)."""
    f64 = torch.float64
    z = inputs.z.to(f64)
    ids = inputs.ids.long()
    y = torch.zeros(z.shape, dtype=f64, device=z.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tokens, slots = torch.nonzero(ids == e, as_tuple=True)
        w13_e = dequantize_mxfp4(w13[e], w13_scale[e], f64)
        w2_e = dequantize_mxfp4(w2[e], w2_scale[e], f64)
        inter = w2_e.shape[1]
        h = z[tokens] @ w13_e.T
        g, u = h[:, :inter], h[:, inter:]
        act = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))
        y.index_add_(0, tokens, inputs.weights[tokens, slots].to(f64)[:, None] * (act @ w2_e.T))
    return y


PREFILL_M = (4096, 8192, 16384, 32768)


def prefill_args(description: str, argv: list[str] | None = None):
    """--out, --m (default PREFILL_M) and --seed: the prefill routed-op benchmarks' command line."""
    import argparse

    from bench.common import RESULTS_DIR

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=str(RESULTS_DIR), help="results folder (default bench/results)")
    ap.add_argument("--m", type=int, nargs="+", default=list(PREFILL_M), help="token counts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if any(m < 1 for m in args.m):
        ap.error("--m values must be >= 1")
    return args


def routed_with_knobs(w: dict[str, torch.Tensor], knobs: dict[str, str]):
    """call(z, ids, weights): lmf::routed_experts on the rank's MXFP4 weights with `knobs` applied while it runs."""
    from bench.common import knobs_applied

    def call(z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with knobs_applied(knobs):
            return torch.ops.lmf.routed_experts(z, ids, weights, w["w13"], w["w2"], w["w13_scale"], w["w2_scale"],
                                                "mxfp4", BETA, LIN_BETA)
    return call
