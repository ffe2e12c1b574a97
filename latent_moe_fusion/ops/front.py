"""The decode front of the shared-first schedule (ops/route_and_produce.py) in one launch: the latent
down-projection z = x @ w_down^T and the shared expert's act = SiTU(x @ w1_s^T, x @ w3_s^T)
(triton_kernels/front_kernels.py); the shared expert's down GEMM then runs by cuBLAS as before.

Why: both read the tokens and stream a weight at the copy rate, and before they ran as a Triton kernel and
cuBLAS's split-K GEMM + reduce + a SiTU pass, which could not share the SMs (each holds most of an SM's
shared memory). One grid of 160 even programs at 4 stages (2 per SM) streams both weights at once.

Numerics: z is the Triton down-projection's (same kernel steps, bitwise at the table's sizes: a GPU test
checks it). The gate and up products are rounded to bf16 and SiTU is computed in FP32 and rounded to bf16,
the library path's roundings, but the products sum in another order than cuBLAS's: act agrees to bf16
rounding, not bitwise.

LMF_FRONT (read per call): "1" / unset: where it applies (below), "0": never (the separate kernels), or a
FrontConfig label such as "16x32x256/w4/st4" (served up to its block_m tokens). It applies on Hopper to
bf16 tensors of one row-major, 16-byte aligned layout when the shared expert reads the router's tokens
(x_s is x: tensor parallelism; sequence parallelism gathers other tokens) and the down-projection is on
its Triton default (LMF_DOWN_PROJECTION unset or "triton"), up to TABLE's last size.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from .device import capability
from .down_projection import DEFAULT_BACKEND as DOWN_DEFAULT
from .down_projection import DOWN_PROJECTION_ENV
from .env import env_choice
from .triton_kernels.tail_configs import _pow2

FRONT_ENV = "LMF_FRONT"
# Where the shared expert's down GEMM runs after the front (A/B switch): "side" (its own stream, beside the
# routed kernels) or "inline" (on the front's stream before the routed L1, which waits for it).
FRONT_SHARED_DOWN_ENV = "LMF_FRONT_SHARED_DOWN"
FRONT_SHARED_DOWN_CHOICES = ("side", "inline")
DEFAULT_SHARED_DOWN = "side"


@dataclass(frozen=True)
class FrontConfig:
    block_m: int  # tokens padded to this (the MMA's N)
    block_n: int  # weight rows per program: w_down rows, or block_n / 2 gate rows and as many up rows
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/st{self.num_stages}"


# (largest M, config); H200, H = 7168, L = 3584, I_s = 768: 112 + 48 programs of 32 weight rows, 2 per SM.
TABLE: tuple[tuple[int, FrontConfig], ...] = (
    (16, FrontConfig(16, 32, 256, num_warps=2)),
    (32, FrontConfig(32, 64, 128)),
    (64, FrontConfig(64, 64, 128)),
)
_LABEL = re.compile(r"(\d+)x(\d+)x(\d+)/w(\d+)/st(\d+)")


def parse_label(label: str) -> FrontConfig:
    """The FrontConfig a label (FrontConfig.label()) names."""
    match = _LABEL.fullmatch(label)
    if match is None:
        raise ValueError(f"{FRONT_ENV}={label!r}: expected 1, 0 or a config label such as 16x32x256/w4/st4 "
                         "(BLOCK_MxBLOCK_NxBLOCK_K/wWARPS/stSTAGES)")
    cfg = FrontConfig(*(int(g) for g in match.groups()))
    for name in ("block_m", "block_n", "block_k", "num_warps"):
        if not _pow2(getattr(cfg, name)):
            raise ValueError(f"{FRONT_ENV}={label!r}: {name} = {getattr(cfg, name)} is not a power of two")
    if cfg.block_m < 16 or cfg.block_n < 32 or cfg.block_k < 16 or not 1 <= cfg.num_stages <= 8:
        raise ValueError(f"{FRONT_ENV}={label!r}: block_m and block_k must be >= 16, block_n >= 32 (two halves of "
                         "16 shared rows), stages 1 .. 8")
    return cfg


def table_config(num_tokens: int) -> FrontConfig | None:
    return next((cfg for bound, cfg in TABLE if num_tokens <= bound), None)


def front_config(num_tokens: int) -> FrontConfig | None:
    """The config LMF_FRONT gives `num_tokens` (None: the separate kernels), before the tensor checks."""
    value = os.environ.get(FRONT_ENV, "") or "1"
    if value == "0":
        return None
    if value == "1":
        return table_config(num_tokens)
    cfg = parse_label(value)
    return cfg if num_tokens <= cfg.block_m else None


def front_shared_down() -> str:
    return env_choice(FRONT_SHARED_DOWN_ENV, FRONT_SHARED_DOWN_CHOICES, "where the shared down GEMM runs") or \
        DEFAULT_SHARED_DOWN


def _tma_layout(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def why_not(x: torch.Tensor, x_s: torch.Tensor, w_down: torch.Tensor, w1_s: torch.Tensor,
            w3_s: torch.Tensor) -> str | None:
    """Why the one-launch front does not serve these tensors (None: it does)."""
    if (os.environ.get(DOWN_PROJECTION_ENV, "") or DOWN_DEFAULT) != "triton":
        return f"{DOWN_PROJECTION_ENV} picks another down-projection kernel"
    if not x.is_cuda or capability(x.device.index)[0] != 9:
        return "the configs are measured on Hopper (sm_90) only"
    if any(t.dtype != torch.bfloat16 for t in (x, w_down, w1_s, w3_s)):
        return "not all of x, w_down, w1_s and w3_s are bfloat16"
    if x_s.data_ptr() != x.data_ptr() or x_s.shape != x.shape or x_s.stride() != x.stride():
        return "the shared expert reads other tokens than the router (x_s is not x)"
    if w1_s.shape != w3_s.shape or w1_s.shape[1] != x.shape[1] or w_down.shape[1] != x.shape[1]:
        return "the weights' K differ from x's"
    if not all(_tma_layout(t) for t in (x, w_down, w1_s, w3_s)):
        return "a tensor is not row-major with 16-byte aligned rows (TMA)"
    return None


def front_fused(x: torch.Tensor, w_down: torch.Tensor, w1_s: torch.Tensor, w3_s: torch.Tensor, z: torch.Tensor,
                act: torch.Tensor, beta: float, lin_beta: float, config: FrontConfig) -> None:
    """z <- round(x @ w_down^T), act <- round(SiTU(round(x @ w1_s^T), round(x @ w3_s^T))) in one launch
    (also under TRITON_INTERPRET). z [M, L] and act [M, I_s] need unit column stride."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .triton_kernels.front_kernels import front_swap_kernel
    from .triton_kernels.tail import _dot_mode, _interpreting

    m, k = x.shape
    if m > config.block_m:
        raise ValueError(f"front config {config.label()} serves up to {config.block_m} tokens, got M = {m}")
    if z.stride(1) != 1 or act.stride(1) != 1 or any(w.stride(1) != 1 for w in (w_down, w1_s, w3_s)):
        raise ValueError("front_fused needs unit column stride in the weights, z and act")
    half = config.block_n // 2
    n_down, inter = w_down.shape[0], w1_s.shape[0]
    grid = (-(-n_down // config.block_n) + -(-inter // half),)
    dot_fp32, precision = _dot_mode(x.dtype)
    front_swap_kernel[grid](
        TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]), w_down, w1_s, w3_s, z, act,
        m, n_down, inter, k, w_down.stride(0), w1_s.stride(0), w3_s.stride(0), z.stride(0), act.stride(0),
        float(beta), float(lin_beta),
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        DOT_FP32=dot_fp32, PRECISION=precision, INTERPRET=_interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
