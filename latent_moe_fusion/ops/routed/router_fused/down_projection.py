"""The latent down-projection z = x @ w_down^T (x [M, H], w_down [L, H]) inside lmf::route_and_project and
lmf::route_and_produce: cuBLAS (torch.mm) or, at decode sizes on CUDA, the tail's Triton swap-AB kernel
with no fragments (common/tail_gemm/tail_launch.py, R = 0).

Why a second kernel: beside the router chain and the shared expert, cuBLAS's split-K GEMM takes every SM
and then a reduce kernel; the swap-AB kernel streams w_down with 112 CTAs at L = 3584 and sums its K slices
in its own last CTA. Both accumulate in FP32 and round once to x's dtype, in different summation orders,
so the two agree to bf16 rounding but not bitwise.

LMF_DOWN_PROJECTION (read per call): "cublas" or "triton" (the table below, cuBLAS beyond it); unset: DEFAULT_BACKEND.
Under "triton" the down_projection_kernel tuning override may name one TailConfig label of a swap kernel instead of the
table, e.g. "swap_tma:16x32x256/w4/st6/s1" (served up to its block_m tokens, cuBLAS beyond). The Triton kernel serves
bf16 on Hopper only (cuBLAS elsewhere).
"""

from __future__ import annotations

import re

import torch

from latent_moe_fusion import envs, tuning

from ...common.device_capability import capability
from ...common.tail_gemm.tail_gemm_configs import TailConfig, _pow2

DOWN_PROJECTION_ENV = "LMF_DOWN_PROJECTION"
KERNEL_OVERRIDE = "down_projection_kernel"  # tuning override: a swap kernel's label instead of TRITON_TABLE
DEFAULT_BACKEND = "triton"  # envs.py's default of DOWN_PROJECTION_ENV

# (largest M, config); H200, H = 7168, L = 3584; 112 CTAs each. Alone over L2-cold weights (bench/results/down_projection.md)
# every entry is 1.04-1.11x faster than cuBLAS; in the block (decode_tuning_down_triton.md) the split-free
# kernel wins at 5-16 tokens, where the two-slice one lost 1.2-1.5 us at M = 16, and loses 1-3 us at 1-2.
TRITON_TABLE: tuple[tuple[int, TailConfig], ...] = (
    (4, TailConfig("swap", 16, 64, 128, num_warps=4, num_stages=6, split_k=2)),
    (16, TailConfig("swap_tma", 16, 32, 256, num_warps=4, num_stages=6, split_k=1)),
    (32, TailConfig("swap_tma", 32, 32, 256, num_warps=4, num_stages=6, split_k=1)),
    (64, TailConfig("swap_tma", 64, 64, 128, num_warps=4, num_stages=6, split_k=2)),
)
_LABEL = re.compile(r"(swap|swap_tma):(\d+)x(\d+)x(\d+)/w(\d+)/st(\d+)/s(\d+)")


def parse_swap_label(label: str) -> TailConfig:
    """The swap-kernel TailConfig a label (TailConfig.label()) names."""
    match = _LABEL.fullmatch(label) if isinstance(label, str) else None
    if match is None:
        raise ValueError(f"{KERNEL_OVERRIDE}={label!r}: expected a swap kernel label such as "
                         "swap_tma:16x32x256/w4/st6/s1 (KERNEL:BLOCK_MxBLOCK_NxBLOCK_K/wWARPS/stSTAGES/sSPLIT_K)")
    kernel = match.group(1)
    bm, bn, bk, warps, stages, split = (int(g) for g in match.groups()[1:])
    for name, value in (("block_m", bm), ("block_n", bn), ("block_k", bk), ("warps", warps), ("split_k", split)):
        if not _pow2(value):
            raise ValueError(f"{KERNEL_OVERRIDE}={label!r}: {name} = {value} is not a power of two")
    if bm < 16 or bn < 16 or bk < 16 or not 1 <= stages <= 8:
        raise ValueError(f"{KERNEL_OVERRIDE}={label!r}: block sizes must be >= 16 and stages 1 .. 8")
    return TailConfig(kernel, bm, bn, bk, num_warps=warps, num_stages=stages, split_k=split)


def _checked_label(name: str, label: str) -> str:
    parse_swap_label(label)
    return label


tuning.register(KERNEL_OVERRIDE, _checked_label)


def table_config(num_tokens: int) -> TailConfig | None:
    """TRITON_TABLE's config for `num_tokens`, None beyond the table (cuBLAS)."""
    return next((cfg for bound, cfg in TRITON_TABLE if num_tokens <= bound), None)


def triton_config(num_tokens: int) -> TailConfig | None:
    """The swap-kernel config that serves `num_tokens` under LMF_DOWN_PROJECTION and the down_projection_kernel
    override, None for cuBLAS."""
    if envs.read(DOWN_PROJECTION_ENV) == "cublas":
        return None
    label = tuning.current().down_projection_kernel
    if label is None:
        return table_config(num_tokens)
    cfg = parse_swap_label(label)
    return cfg if num_tokens <= cfg.block_m else None


def _measured_for(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and capability(x.device.index)[0] == 9


def project_down_triton(x: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor, config: TailConfig) -> torch.Tensor:
    """out = round(x @ w_down^T) by the tail's swap-AB kernel with no fragments (also under TRITON_INTERPRET)."""
    from ...common.tail_gemm.tail_launch import tail_fused

    no_fragments = x.new_empty((0, x.shape[0], w_down.shape[0]))
    # Not a programmatic dependent: its stream's previous kernel is unrelated work (it forks from the caller).
    return tail_fused(x, w_down, no_fragments, out, config, pdl=False, counter_user="down_projection")


def project_down(x: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x @ w_down^T by the kernel LMF_DOWN_PROJECTION picks for this size; cuBLAS where the configs were
    not measured: off Hopper (sm_90) and for other dtypes than bf16."""
    config = triton_config(x.shape[0]) if _measured_for(x) else None
    if config is None:
        return torch.mm(x, w_down.t(), out=out)
    return project_down_triton(x, w_down, out, config)
