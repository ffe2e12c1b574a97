"""Random arguments for the lmf ops, and the fused call (producer then tail) built from a block's parameters.

Argument builders return dicts keyed by the schema's argument names, so a test can call
`torch.ops.lmf.<op>(**args)` or replace one argument by name to make it bad.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from latent_moe_fusion import KimiK3MoEBlock, KimiK3MoEConfig
from latent_moe_fusion.model.router import localize_ids, route
from latent_moe_fusion.ops.common.fragment_layouts import resolve_group

TINY = KimiK3MoEConfig.tiny()


def randn(shape, gen: torch.Generator, std: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def distinct_ids(m: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[m, top_k] int32, distinct experts per token (as top-k gives)."""
    return torch.rand(m, num_experts, generator=gen).argsort(dim=-1)[:, :top_k].to(torch.int32).contiguous()


def random_mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes [..., N, K/2] and E8M0 scales [..., N, K/32] with entries of std ~ K**-0.5."""
    *lead, n, k = shape
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=gen, dtype=torch.uint8)
    # Uniform e2m1 codes have rms ~2.9; 2**-5 .. 2**-3 keeps the products O(1) for K = 64 .. 128.
    scales = torch.randint(122, 125, (*lead, n, k // 32), generator=gen, dtype=torch.uint8)
    return packed, scales


def routed_args(
    m: int,
    dtype: torch.dtype,
    weight_format: str,
    gen: torch.Generator,
    cfg: KimiK3MoEConfig = TINY,
    ids: torch.Tensor | None = None,
) -> dict:
    e, k, lat, i = cfg.num_experts, cfg.top_k, cfg.latent_size, cfg.moe_intermediate_size
    if ids is None:
        ids = distinct_ids(m, e, k, gen)
    weights = torch.rand(ids.shape, generator=gen) + 0.1
    args = {
        "z": randn((m, lat), gen, dtype=dtype),
        "topk_ids": ids,
        "topk_weights": (weights / weights.sum(dim=-1, keepdim=True)).contiguous(),
    }
    if weight_format == "mxfp4":
        args["w13"], args["w13_scale"] = random_mxfp4((e, 2 * i, lat), gen)
        args["w2"], args["w2_scale"] = random_mxfp4((e, lat, i), gen)
    else:
        args["w13"], args["w13_scale"] = randn((e, 2 * i, lat), gen, lat**-0.5, dtype), None
        args["w2"], args["w2_scale"] = randn((e, lat, i), gen, i**-0.5, dtype), None
    args.update(weight_format=weight_format, beta=cfg.situ_beta, lin_beta=cfg.situ_linear_beta)
    return {name: args[name] for name in ROUTED_ARG_ORDER}


ROUTED_ARG_ORDER = (
    "z", "topk_ids", "topk_weights", "w13", "w2", "w13_scale", "w2_scale", "weight_format", "beta", "lin_beta",
)


def producer_args(
    m: int,
    dtype: torch.dtype,
    weight_format: str,
    gen: torch.Generator,
    mode: str = "local",
    group_name: str | None = None,
    world: int = 1,
    cfg: KimiK3MoEConfig = TINY,
) -> dict:
    """Arguments of moe_shared_producer on one of `world` ranks (shared weights: this rank's I_s/R shard)."""
    h, i_s = cfg.hidden_size, cfg.shared_intermediate_size // world
    m_s = world * m if mode == "token_publish" else m
    args = routed_args(m, dtype, weight_format, gen, cfg)
    args.update(
        rms_weight=(1.0 + randn((cfg.latent_size,), gen, 0.1)).to(dtype),
        eps=cfg.rms_norm_eps,
        x_s=randn((m_s, h), gen, dtype=dtype),
        w1_s=randn((i_s, h), gen, h**-0.5, dtype),
        w3_s=randn((i_s, h), gen, h**-0.5, dtype),
        w2_s=randn((h, i_s), gen, cfg.shared_intermediate_size**-0.5, dtype),
        mode=mode,
        group_name=group_name,
    )
    return args


def tail_args(
    m: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    mode: str = "local",
    group_name: str | None = None,
    world: int = 1,
    cfg: KimiK3MoEConfig = TINY,
) -> dict:
    h, lat = cfg.hidden_size, cfg.latent_size
    ws_shape = {"local": (1, m, h), "hidden_scatter": (world, m, h // world), "token_publish": (m, world, h)}[mode]
    return {
        "y_n": randn((m, lat), gen, dtype=dtype),
        "w_up": randn((h, lat), gen, lat**-0.5, dtype),
        "ws": randn(ws_shape, gen, dtype=dtype),
        "mode": mode,
        "group_name": group_name,
    }


# -- the fused path built from a block's parameters -----------------------------------------------------------------


def shared_gate_up(block: KimiK3MoEBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1_s, w3_s): for a merged parameter, two row-block views of it (no copy)."""
    if block.shared_gate_up == "merged":
        i_s = block.shared_w13.shape[0] // 2
        return block.shared_w13[:i_s], block.shared_w13[i_s:]
    return block.shared_w1, block.shared_w3


def fused_mode(block: KimiK3MoEBlock) -> str:
    if block.tp_world == 1:
        return "local"
    return "token_publish" if block.sequence_parallel else "hidden_scatter"


def fused_producer_args(block: KimiK3MoEBlock, x: torch.Tensor) -> dict:
    cfg = block.cfg
    ids, weights = route(x, block.gate_weight, block.correction_bias, cfg.top_k, cfg.routed_scaling_factor,
                         block.router_gemm)
    if block.ep_size > 1:
        ids = localize_ids(ids, block.first_expert, block.num_local_experts)
    mode = fused_mode(block)
    if mode == "token_publish":
        chunks = [torch.empty_like(x) for _ in range(block.tp_world)]
        dist.all_gather(chunks, x.contiguous(), group=resolve_group(block.group_name))
        x_s = torch.cat(chunks)  # rank-major tokens
    else:
        x_s = x
    w1_s, w3_s = shared_gate_up(block)
    return {
        "z": F.linear(x, block.w_down), "topk_ids": ids, "topk_weights": weights,
        "w13": block.w13, "w2": block.w2, "w13_scale": block.w13_scale, "w2_scale": block.w2_scale,
        "weight_format": block.weight_format, "beta": cfg.situ_beta, "lin_beta": cfg.situ_linear_beta,
        "rms_weight": block.norm_weight, "eps": cfg.rms_norm_eps,
        "x_s": x_s, "w1_s": w1_s, "w3_s": w3_s, "w2_s": block.shared_w2,
        "mode": mode, "group_name": block.group_name,
    }


def fused_forward(block: KimiK3MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """latent_tail(moe_shared_producer(...)): the fused graph the pass emits for this block."""
    args = fused_producer_args(block, x)
    y_n, ws = torch.ops.lmf.moe_shared_producer(**args)
    return torch.ops.lmf.latent_tail(y_n, block.w_up, ws, args["mode"], args["group_name"])
