"""The routed MXFP4 decode problems the routed benchmarks (routed_gemv.py, routed_fp8.py) time on one rank of Kimi K3
at EP8: the expert bytes behind their floors and the routings, one token per row (what the block sees at decode: top-16
of 896 kept where local, ~2 of the rank's 112 experts per token) and the producer benchmark's 8 global tokens per row."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from bench.producer import (
    DT,
    GLOBAL_EXPERTS,
    INTER,
    LATENT,
    LOCAL_EXPERTS,
    TOP_K,
    Case,
    make_rms_weight,
    make_sets,
    make_shared_weights,
    make_weights,
)
from latent_moe_fusion.ops.common.reference_math import routed_experts_math
from latent_moe_fusion.ops.routed.producer_config import ProducerConfig, pick_config

L1_BYTES = 2 * INTER * (LATENT // 2 + LATENT // 32)  # per expert: gate + up codes and scales
L2_BYTES = LATENT * (INTER // 2 + INTER // 32)


def one_token_sets(m: int, n_sets: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """make_sets with one global token per row: its top-16 of 896 experts, the slots of other ranks' experts -1."""
    sets = make_sets(m, n_sets, gen)
    for s in sets:
        scores = torch.rand(m, GLOBAL_EXPERTS, generator=gen)
        top_s, top_i = scores.topk(TOP_K, dim=1)
        ids = torch.where(top_i < LOCAL_EXPERTS, top_i, -1).to(torch.int32)
        s["ids"], s["w"] = ids.cuda(), (top_s / top_s.sum(1, keepdim=True)).float().cuda()
    return sets


ROUTINGS = (("1 token/row", one_token_sets), ("8 tokens/row", make_sets))


@dataclass(frozen=True)
class DecodeCase:
    routing: str
    m: int
    case: Case
    picked: ProducerConfig
    hit: float  # experts hit per input set, mean
    l1_floor_us: float
    l2_floor_us: float
    ref: torch.Tensor  # routed_experts_math of input set 0


def decode_cases(ms: list[int], seed: int, bytes_per_s: float) -> Iterator[DecodeCase]:
    """Per routing and M: inputs (4 rotating sets), the picked config, the experts hit with their L1 / L2 byte floors,
    and the FP32 reference."""
    gen = torch.Generator().manual_seed(seed)
    weights = make_weights("mxfp4", gen)
    shared_w, rms_w = make_shared_weights(), make_rms_weight()
    for routing, make in ROUTINGS:
        for m in ms:
            case = Case(m, "mxfp4", weights, shared_w, rms_w, make(m, 4, gen))
            hit = case.hit_experts()
            yield DecodeCase(routing, m, case, pick_config(m * TOP_K, "mxfp4", DT, LOCAL_EXPERTS), hit,
                             hit * L1_BYTES / bytes_per_s * 1e6, hit * L2_BYTES / bytes_per_s * 1e6,
                             routed_experts_math(*case.routed_args(case.sets[0])))
