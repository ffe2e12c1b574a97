"""The opt-in W4A8 prefill path (LMF_ROUTED_W4A8=1): when a call can take it, and its launches.

A call on the 128-row staged blocks runs, instead of the BF16 staged kernels: z quantised per token in 1 x 128 e4m3
blocks (triton/quantize_1x128.py), L1 on FP8 wgmma (gluon/routed_w4a8.py) writing bf16 SiTU rows, those rows
quantised the same way (padding rows skipped), L2 on FP8 wgmma writing the FP32 pair rows the combine reads. The
numerics are w4a8_numerics.py's definition; the weights' 64 x 128 block exponents are worked out once per weight
tensor and kept (block_exponents_of).
"""

from __future__ import annotations

import weakref

import torch

from latent_moe_fusion import envs, tuning

from ..common.mxfp4 import BLOCK as MXFP4_BLOCK
from .w4a8_numerics import ACT_BLOCK, WEIGHT_BLOCK_ROWS, block_exponents

ROUTED_W4A8_ENV = "LMF_ROUTED_W4A8"  # the opt-in switch (envs.py)
W4A8_BLOCK_ROWS = 128  # token rows per program: the staged blocks
W4A8_WARPS = 8  # two warp groups of 64 token rows
W4A8_K_MULTIPLE = 4 * ACT_BLOCK  # whole rounds of the 4-stage rings of 128-wide steps
# Weight rows per program: 128 (one CTA per SM: accumulators and step sums take 128 registers a thread) or 64 (two
# CTAs of 8 warps per SM under a 128-register cap, 112 KB of shared memory each). H200, Kimi K3 rank, M = 4096 ..
# 32768 (bench/results/w4a8_routed.md): 128 rows 1.25-1.30x faster than 64 (the 64-row programs read the activation
# tile twice as often per MMA and run N = 32 wgmma). The w4a8_rows override picks.
W4A8_ROWS = (64, 128)
W4A8_DEFAULT_ROWS = 128
W4A8_MAX_REGISTERS = {64: 128, 128: None}
ROWS_OVERRIDE = "w4a8_rows"
tuning.register(ROWS_OVERRIDE, tuning.choice(tuple(map(str, W4A8_ROWS)), "weight rows per W4A8 program"))


def w4a8_rows() -> int:
    """Weight rows per program of the W4A8 kernels (the w4a8_rows override, else W4A8_DEFAULT_ROWS)."""
    chosen = tuning.current().w4a8_rows
    return W4A8_DEFAULT_ROWS if chosen is None else int(chosen)


def routed_w4a8_requested() -> bool:
    """Whether ROUTED_W4A8_ENV asks for the W4A8 prefill kernels (the routed plan reads it per call; its raw value
    keys the memoised plans, producer_config.routed_switches)."""
    return bool(envs.read(ROUTED_W4A8_ENV))


def w4a8_shape_reason(latent: int, inter: int, weight_format: str, dtype: torch.dtype,
                      capability: tuple[int, int] | None) -> str | None:
    """Why a call of these sizes cannot run on the W4A8 kernels (None if it can); the tensors' checks are the staged
    kernels' (regs_tensor_reason), which the call has passed when it runs on them."""
    if weight_format != "mxfp4":
        return "only MXFP4 weights"
    if capability != (9, 0):
        return "needs an sm_90 GPU (FP8 wgmma)"
    if dtype != torch.bfloat16:
        return f"activations must be bfloat16, got {dtype}"
    if latent % W4A8_K_MULTIPLE or inter % W4A8_K_MULTIPLE:
        return (f"L = {latent} and I = {inter} must be multiples of {W4A8_K_MULTIPLE} (whole rounds of the W4A8 "
                "kernels' 4-stage rings of 128-wide k steps)")
    return None


_exponents: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _forget(ref: weakref.ref, key: int) -> None:
    if _exponents.get(key, (None,))[0] is ref:  # not a newer tensor's entry under a reused id
        del _exponents[key]


def block_exponents_of(scales: torch.Tensor) -> torch.Tensor:
    """block_exponents(scales), kept while the tensor lives (keyed by the tensor object, not its storage address,
    which a freed tensor hands on; an in-place update, which bumps its version, recomputes)."""
    found = _exponents.get(id(scales))
    if found is not None and found[0]() is scales and found[1] == scales._version:
        return found[2]
    exponents = block_exponents(scales).contiguous()
    key = id(scales)
    _exponents[key] = (weakref.ref(scales, lambda ref, key=key: _forget(ref, key)), scales._version, exponents)
    return exponents


_tables: dict[torch.device, torch.Tensor] = {}


def _shift_tables(device: torch.device) -> torch.Tensor:
    from .gluon.routed_w4a8 import shift_tables

    if device not in _tables:
        _tables[device] = shift_tables(device)
    return _tables[device]


def clear_block_exponents() -> None:
    """Forget the kept exponents (tests; a process that frees and reallocates weight tensors in place)."""
    _exponents.clear()


def _descriptor(words: torch.Tensor, gated: bool, rows: int):
    """TMA descriptor of a 128-wide k step of a program's `rows` weight rows (gluon.step_descriptor)."""
    from .gluon import step_descriptor

    return step_descriptor(words, gated, rows, ACT_BLOCK)


def _check(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, k: int, n: int, n_multiple: int) -> None:
    """A clear error for a call the W4A8 kernels cannot take (the plan never sends one: this guards direct calls)."""
    cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
    why = None
    if cap != (9, 0):
        why = f"needs an sm_90 GPU (FP8 wgmma), got {'capability ' + str(cap) if cap else x.device}"
    elif x.dtype != torch.bfloat16:
        why = f"activations must be bfloat16, got {x.dtype}"
    elif k % W4A8_K_MULTIPLE:
        why = f"K = {k} must be a multiple of {W4A8_K_MULTIPLE}"
    elif n % n_multiple:
        why = f"N = {n} must be a multiple of {n_multiple}"
    elif not (w.is_contiguous() and scales.is_contiguous() and w.dtype == torch.uint8 and scales.dtype == torch.uint8
              and scales.shape[-1] * MXFP4_BLOCK == k and w.data_ptr() % 16 == 0):
        why = "weights and scales must be contiguous uint8 MXFP4 (16-byte aligned weights, [E, N, K/32] scales)"
    if why is not None:
        raise ValueError(f"the W4A8 kernels cannot take this call: {why}")


def launch_l1_w4a8(
    z: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, act: torch.Tensor, num_blocks: int, top_k: int, beta: float, lin_beta: float,
) -> None:
    """act[block rows, :I] = bf16(SiTU(gate, up)) of every used 128-row block on FP8 wgmma (z quantised here)."""
    from .gluon.routed_w4a8 import l1_w4a8_kernel
    from .triton.quantize_1x128 import quantize_1x128

    latent, inter = z.shape[1], w13.shape[1] // 2
    _check(z, w13, w13_scale, latent, inter, WEIGHT_BLOCK_ROWS)
    rows = w4a8_rows()
    z8, zs = quantize_1x128(z.contiguous())
    exps = block_exponents_of(w13_scale)
    grid = (num_blocks * (inter // (rows // 2)),)
    l1_w4a8_kernel[grid](
        z8, zs, w13_scale, exps, _shift_tables(z.device), sorted_pairs, block_expert, act, inter, latent, latent // MXFP4_BLOCK, top_k,
        w13_scale.stride(0), exps.stride(0), float(beta), float(lin_beta),
        _descriptor(w13.view(torch.int32), True, rows), BM=W4A8_BLOCK_ROWS, BN=rows, num_warps=W4A8_WARPS,
        maxnreg=W4A8_MAX_REGISTERS[rows],
    )


def launch_l2_w4a8(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, pairs: torch.Tensor, num_blocks: int,
) -> None:
    """pairs[pair, :] = act[row] @ W2[e]^T in FP32 for every valid row on FP8 wgmma (act rows quantised here)."""
    from .gluon.routed_w4a8 import l2_w4a8_kernel
    from .triton.quantize_1x128 import quantize_1x128

    latent, inter = w2.shape[1], act.shape[1]
    rows = w4a8_rows()
    _check(act, w2, w2_scale, inter, latent, rows)
    a8, a_scales = quantize_1x128(act[: num_blocks * W4A8_BLOCK_ROWS], live=sorted_pairs)
    exps = block_exponents_of(w2_scale)
    grid = (num_blocks * (latent // rows),)
    l2_w4a8_kernel[grid](
        a8, a_scales, w2_scale, exps, _shift_tables(act.device), sorted_pairs, block_expert, pairs, latent, inter, inter // MXFP4_BLOCK,
        w2_scale.stride(0), exps.stride(0), _descriptor(w2.view(torch.int32), False, rows), BM=W4A8_BLOCK_ROWS,
        BN=rows, num_warps=W4A8_WARPS, maxnreg=W4A8_MAX_REGISTERS[rows],
    )
