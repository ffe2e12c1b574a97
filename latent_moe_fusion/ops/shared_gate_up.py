"""The shared expert's gate/up GEMM + SiTU in one Triton launch at decode sizes
(triton_kernels/shared_gate_up.py), for the shared-first schedule of lmf::route_and_produce; its down GEMM
stays on cuBLAS.

Why: there the shared expert runs beside the down-projection, which the routed L1 waits for. cuBLAS's
split-K gate/up GEMM takes every SM, then a reduce kernel and the SiTU pass follow; the down-projection's
programs start only as the GEMM's retire. One launch of 48 programs (16 gate + 16 up rows each at
I_s = 768) on 48 SMs leaves the others to the down-projection.

Numerics: the gate and up products are rounded to bf16 and SiTU is computed in FP32 and rounded to bf16,
the library path's roundings, but the products sum in another order than cuBLAS's: act agrees to bf16
rounding, not bitwise.

LMF_SHARED_GATE_UP (read per call): "cublas" (the library GEMM), "triton" (TABLE up to its last size,
cuBLAS beyond) or a config label such as "16x32x256/w2/st4" (up to its block_m tokens). It applies on
Hopper to bf16 tensors of one row-major, 16-byte aligned layout; elsewhere cuBLAS.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from .device import capability
from .triton_kernels.tail_configs import _pow2

SHARED_GATE_UP_ENV = "LMF_SHARED_GATE_UP"
DEFAULT_BACKEND = "cublas"


@dataclass(frozen=True)
class GateUpConfig:
    block_m: int  # tokens padded to this (the MMA's N)
    block_n: int  # weight rows per program: block_n / 2 gate rows and as many up rows
    block_k: int
    num_warps: int = 4
    num_stages: int = 4

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}/w{self.num_warps}/st{self.num_stages}"


# (largest M, config); H200, H = 7168, I_s = 768.
TABLE: tuple[tuple[int, GateUpConfig], ...] = (
    (16, GateUpConfig(16, 32, 256, num_warps=2)),
    (32, GateUpConfig(32, 32, 256)),
    (64, GateUpConfig(64, 32, 128)),
)
_LABEL = re.compile(r"(\d+)x(\d+)x(\d+)/w(\d+)/st(\d+)")


def parse_label(label: str) -> GateUpConfig:
    """The GateUpConfig a label (GateUpConfig.label()) names."""
    match = _LABEL.fullmatch(label)
    if match is None:
        raise ValueError(f"{SHARED_GATE_UP_ENV}={label!r}: expected cublas, triton or a config label such as "
                         "16x32x256/w2/st4 (BLOCK_MxBLOCK_NxBLOCK_K/wWARPS/stSTAGES)")
    cfg = GateUpConfig(*(int(g) for g in match.groups()))
    for name in ("block_m", "block_n", "block_k", "num_warps"):
        if not _pow2(getattr(cfg, name)):
            raise ValueError(f"{SHARED_GATE_UP_ENV}={label!r}: {name} = {getattr(cfg, name)} is not a power of two")
    if cfg.block_m < 16 or cfg.block_n < 32 or cfg.block_k < 16 or not 1 <= cfg.num_stages <= 8:
        raise ValueError(f"{SHARED_GATE_UP_ENV}={label!r}: block_m and block_k must be >= 16, block_n >= 32 (two "
                         "halves of 16 rows), stages 1 .. 8")
    return cfg


def table_config(num_tokens: int) -> GateUpConfig | None:
    return next((cfg for bound, cfg in TABLE if num_tokens <= bound), None)


def gate_up_config(num_tokens: int) -> GateUpConfig | None:
    """The config LMF_SHARED_GATE_UP gives `num_tokens` (None: cuBLAS), before the tensor checks."""
    value = os.environ.get(SHARED_GATE_UP_ENV, "") or DEFAULT_BACKEND
    if value == "cublas":
        return None
    if value == "triton":
        return table_config(num_tokens)
    cfg = parse_label(value)
    return cfg if num_tokens <= cfg.block_m else None


def _tma_layout(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def why_not(x_s: torch.Tensor, w1_s: torch.Tensor, w3_s: torch.Tensor) -> str | None:
    """Why the Triton launch does not serve these tensors (None: it does)."""
    if not x_s.is_cuda or capability(x_s.device.index)[0] != 9:
        return "the configs are measured on Hopper (sm_90) only"
    if any(t.dtype != torch.bfloat16 for t in (x_s, w1_s, w3_s)):
        return "not all of x_s, w1_s and w3_s are bfloat16"
    if w1_s.shape != w3_s.shape or w1_s.shape[1] != x_s.shape[1]:
        return "w1_s and w3_s are not two [I_s, H] weights for x_s [M, H]"
    if not all(_tma_layout(t) for t in (x_s, w1_s, w3_s)):
        return "a tensor is not row-major with 16-byte aligned rows"
    return None


def gate_up_act(x_s: torch.Tensor, w1_s: torch.Tensor, w3_s: torch.Tensor, act: torch.Tensor, beta: float,
                lin_beta: float, config: GateUpConfig) -> torch.Tensor:
    """act <- round(SiTU(round(x_s @ w1_s^T), round(x_s @ w3_s^T))) in one launch (also under TRITON_INTERPRET).
    The weights and act need unit column stride."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .triton_kernels.shared_gate_up import shared_gate_up_kernel
    from .triton_kernels.tail import _dot_mode, _interpreting

    m, k = x_s.shape
    if m > config.block_m:
        raise ValueError(f"gate/up config {config.label()} serves up to {config.block_m} tokens, got M = {m}")
    if act.stride(1) != 1 or w1_s.stride(1) != 1 or w3_s.stride(1) != 1:
        raise ValueError("gate_up_act needs unit column stride in w1_s, w3_s and act")
    inter = w1_s.shape[0]
    dot_fp32, precision = _dot_mode(x_s.dtype)
    shared_gate_up_kernel[(-(-inter // (config.block_n // 2)),)](
        TensorDescriptor.from_tensor(x_s, [config.block_m, config.block_k]), w1_s, w3_s, act,
        m, inter, k, w1_s.stride(0), w3_s.stride(0), act.stride(0), float(beta), float(lin_beta),
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        DOT_FP32=dot_fp32, PRECISION=precision, INTERPRET=_interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return act
