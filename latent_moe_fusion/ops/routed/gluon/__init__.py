"""Gluon kernels (sm_90): routed MXFP4 decode GEMMs with register-resident dequantisation (routed_gemm.py), the
prefill GEMMs of the 128-row blocks (routed_kappa.py, the default, launched by routed/kappa_path.py; routed_staged.py
and its warp-specialised form routed_staged_ws.py, launched here), and the CUDA-core GEMVs for one to four tokens
(gluon_routed_gemv.py, launched by routed/routed_gemv.py).

Picked by the routed plan (routed/routed_plan.py) for MXFP4 blocks on Hopper; `regs_path_reason` says why a call
cannot take them (None if it can).
The mxfp4_regs tuning override False turns the path off (the Triton kernels then run alone, as before).
"""

from __future__ import annotations

from typing import Any

import torch

from latent_moe_fusion import envs, tuning

from ...common.device_capability import capability
from ...common.mxfp4 import BLOCK as MXFP4_BLOCK
from ...common.triton_compat import gluon_unsupported_reason
from ..routed_thresholds import ROUTED_THRESHOLDS

REGS_OVERRIDE = "mxfp4_regs"  # tuning override; read by producer_config.regs_enabled too (the picked config)
BLOCK_ROWS = (16, 32, 64, 128)  # rows per expert block the kernels take (the MMA's N at most; decode: 16, 32)
# A block runs the MMA with N = 16 or 32 on its first rows where no more of them hold a pair (routed_gemm.
# _valid_rows). 64-row blocks serve beyond decode: each block dequantises its weights once for twice the rows.
# 128-row blocks run the kappa kernels (routed_kappa.py: weights dequantised into the wgmma's register operand,
# activations in kappa order by TMA) or, under the staged_kernel override, the staged kernels (routed_staged.py:
# weights dequantised into shared memory) or their warp-specialised form (their launches: staged_launch.py); each
# picks the MMA's N by the block's valid rows.
STAGED_BLOCK_ROWS = 128
STAGED_WARPS = 8  # two warp groups, 128 weight rows per program (L1: 64 gate + 64 up columns)
STAGED_STEP_K = 64
STAGED_K_MULTIPLE = 4 * STAGED_STEP_K  # the k loop runs whole rounds of its 4-stage rings
# 2 CTAs per SM: 112 KB of shared memory each and at most 128 registers (L1 takes 135 uncapped, no spills under the
# cap). H200, EP share of M = 4096: L1 1345 us at one CTA per SM, 1090 at two (docs/design/prefill.md).
STAGED_MAX_REGISTERS = 128
# H200, Kimi K3 rank, L1 + L2 alone (docs/design/prefill.md): 64-row blocks (TMA rings, uncapped) against
# 32-row blocks (L2 on the cp.async ring beyond L2_TMA_MAX_PAIRS) 0.98x at 30 rows per hit expert, 1.09x at 57,
# 1.14x at 108, 1.20x at 211, 1.27x at 392 (EP share), 1.15x at 146, 1.27x at 293, 1.25x at 585 (all local).
STEP_K = 128  # k per mainloop step: one 32-block per thread
FP8_BLOCK_ROWS = (8, 16, 32)  # the FP8 kernels' blocks (routed_fp8.py)
FP8_K_MULTIPLE = 4 * STEP_K  # the FP8 kernels' K: whole rounds of their 4-stage rings
FP8_WORDS_SWIZZLE = 64  # bytes: the FP8 kernels' 4-byte reads of a [rows, 16 words] stage are then conflict-free
# H200: 4 warps beat 8 for L1 (2 accumulators), 8 beat 4 for L2 (docs/design/routed-decode.md)
L1_WARPS, L2_WARPS = 4, 8
ROW_TILES = (16 * L1_WARPS, 16 * L2_WARPS)  # weight rows per program (16 per warp)
# How the weight words reach the registers: "loads" (16-byte loads one k step ahead: bytes in flight bounded
# by registers), or a ring of shared-memory stages (k steps in flight independent of registers) filled per
# thread by cp.async ("cp2", "cp4": 1 / 3 steps ahead) or by TMA ("tma": 4 stages, 3 steps ahead; L1's
# gate and up tiles in one box). All give the same bits. H200 (docs/design/routed-decode.md, one token per
# row): L1 and L2 fastest on the TMA ring at M = 8 / 32 / 128 (128 / 512 / 2048 pairs; L2 at M = 128 198
# against 216 us on the cp.async ring since the TMA ring's single activation buffer ended its spills, 249
# against 218 before). Beyond the pairs measured, L2 keeps the cp.async ring.
WEIGHT_RINGS = {"loads": ("loads", 0), "cp2": ("cp", 2), "cp4": ("cp", 4), "tma": ("tma", 4)}
L2_TMA_MAX_PAIRS = ROUTED_THRESHOLDS.value("l2_tma_max_pairs")


def default_rings(num_pairs: int, block_m: int = 32) -> tuple[str, str]:
    """The measured choice of rings (L1, L2) for a call with num_pairs (token, slot) pairs in block_m-row blocks:
    64-row blocks take the TMA ring for L2 at any size (1.4-1.6x faster than the cp.async ring uncapped, 1.1-1.25x
    than capped at 128 registers, where it spills 12: docs/design/prefill.md)."""
    return "tma", "tma" if num_pairs <= L2_TMA_MAX_PAIRS or block_m == 64 else "cp4"


RING_OVERRIDE = "mxfp4_ring"  # tuning override: a WEIGHT_RINGS name for both kernels, or "L1,L2"
# When the TMA ring's step issues the next step's scales and activation tile (ring_loops._next_scales_act):
# "auto" (after the step's barrier for 32-row MMAs, before its stage wait for 16-row ones), "early", "late".
LOAD_ORDER_OVERRIDE = "mxfp4_load_order"  # tuning override
LOAD_ORDERS = ("auto", "early", "late")
# Register caps, for 4 CTAs of 4 warps (L1) and 3 of 8 warps (L2) per SM without spills (tests/test_gluon_compile_sm90.py): L1's
# loads loop would take 151 registers and L2's unrolled rings up to 103 (its K-sliced loads, a single
# token's rare path, spill 2 under the cap). L1's TMA ring takes 128 by itself but spills under an explicit
# cap of 128 (ptxas), so it runs uncapped.
L1_MAX_REGISTERS, L2_MAX_REGISTERS = 128, 80
# 64-row blocks run uncapped: L1 takes 252 registers (2 CTAs per SM), L2 128 on the TMA ring; L2 capped at 80
# spills 122 registers and ran 1.6-2.3x slower (docs/design/prefill.md).


# Tuning override of those caps: "L1,L2" (or one value for both), each a register count in 24 .. 255, "none" (uncapped) or "auto"
# (the default above), e.g. "128,auto" caps L1's TMA ring at 128 (4 CTAs per SM instead of 3 at 32 rows).
MAXNREG_OVERRIDE = "mxfp4_maxnreg"


def _per_kernel(value: Any) -> tuple[Any, ...]:
    """An "L1,L2" tuning value (text or a pair) split in two (one value serves both); the caller checks the parts."""
    parts = tuning.pair(value, ",")
    return parts * 2 if len(parts) == 1 else parts


def _maxnreg_caps(name: str, value: Any) -> tuple[int | str, int | str]:
    """The override as (L1, L2), each a register count, "none" or "auto"."""
    parts = _per_kernel(value)
    counts = tuple(tuning.whole_number(p) for p in parts)
    ok = len(parts) == 2 and all(p in ("auto", "none") or (n is not None and 24 <= n <= 255)
                                 for p, n in zip(parts, counts, strict=True))
    if not ok:
        raise ValueError(f"{name}={value!r}: expected L1,L2 (or one value for both), each a register "
                         "count in 24 .. 255, 'none' (uncapped) or 'auto' (the measured default), e.g. 128,auto")
    return tuple(p if n is None else n for p, n in zip(parts, counts, strict=True))


tuning.register(MAXNREG_OVERRIDE, _maxnreg_caps)


def max_registers(kernel: str, ring_kind: str, block_m: int = 32) -> int | None:
    """The maxnreg a register-dequant kernel ("l1" / "l2") is launched with for its ring kind and block rows
    (the mxfp4_maxnreg override overrides it)."""
    caps = tuning.current().mxfp4_maxnreg or ("auto", "auto")
    override = caps[0 if kernel == "l1" else 1]
    if override == "none":
        return None
    if override != "auto":
        return override
    if block_m == 64:
        return None
    if kernel == "l1":
        return None if ring_kind == "tma" else L1_MAX_REGISTERS
    return L2_MAX_REGISTERS


def _gluon_importable() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


tuning.register(REGS_OVERRIDE, tuning.switch(on="these kernels wherever they can run, the default",
                                             off="the Triton tiles"))


def regs_switched_off() -> bool:
    """mxfp4_regs=False: the routed MXFP4 experts on the Triton tiles instead of these kernels (True or None: these
    kernels wherever they can run)."""
    return tuning.current().mxfp4_regs is False


def regs_path_reason(
    z: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None, weight_format: str, block_m: int, fp8: tuple[bool, bool] = (False, False),
) -> str | None:
    """Why these routed GEMMs cannot run on the register-dequant kernels (None if they can); fp8: (L1, L2) on FP8
    MMAs (launch_routed_l1_fp8, launch_routed_l2_fp8)."""
    device_capability = capability(z.device.index) if z.is_cuda else None
    why = regs_shape_reason(z.shape[1], w2.shape[-1] * 2, z.dtype, weight_format, block_m, fp8, device_capability)
    return why if why is not None else regs_tensor_reason(w13, w2, w13_scale, w2_scale)


def regs_tensor_reason(
    w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None,
) -> str | None:
    """regs_path_reason's checks of the weights' tensors (asked after regs_shape_reason's, in this order)."""
    for w, s in ((w13, w13_scale), (w2, w2_scale)):
        if not (w.is_contiguous() and s is not None and s.is_contiguous()) or w.data_ptr() % 16:
            return "weights and scales must be contiguous with 16-byte aligned weights"
        if s.shape[-1] * MXFP4_BLOCK != w.shape[-1] * 2:
            return "scale shape does not match the weight"
    return gluon_missing_reason()


def gluon_missing_reason() -> str | None:
    """Why this Triton cannot build the register-dequant kernels though its version is served (None if it can)."""
    return None if _gluon_importable() else "this triton has no Gluon hopper module"


def regs_shape_reason(
    latent: int, inter: int, dtype: torch.dtype, weight_format: str, block_m: int, fp8: tuple[bool, bool],
    device_capability: tuple[int, int] | None,
) -> str | None:
    """regs_path_reason's checks that need no tensor (sizes, dtype, the device's capability, None: not on a CUDA
    device; switches and this Triton), in its order; routed_plan.py asks them for a shape alone."""
    if regs_switched_off():
        return f"{REGS_OVERRIDE}=False"
    if weight_format != "mxfp4":
        return "only MXFP4 weights"
    if envs.read("TRITON_INTERPRET"):
        return "Gluon kernels do not run under TRITON_INTERPRET=1"
    if (unsupported := gluon_unsupported_reason()) is not None:
        return unsupported
    if device_capability != (9, 0):
        return "needs an sm_90 GPU (warpgroup MMA with a register operand)"
    if dtype != torch.bfloat16:
        return f"activations must be bfloat16, got {dtype}"
    rows = FP8_BLOCK_ROWS if any(fp8) else BLOCK_ROWS
    if block_m not in rows:
        return f"blocks of {', '.join(map(str, rows))} rows only (this batch groups by {block_m})"
    for on, k, name in ((fp8[0], latent, "L"), (fp8[1], inter, "I")):
        if on and k % FP8_K_MULTIPLE:
            return f"the FP8 kernels run whole rounds of their 4-stage rings: {name} = {k} must be a multiple of {FP8_K_MULTIPLE}"
    if latent % max(STEP_K, ROW_TILES[1]) or inter % max(STEP_K, ROW_TILES[0]):
        return f"L = {latent} must be a multiple of {max(STEP_K, ROW_TILES[1])} and I = {inter} of {max(STEP_K, ROW_TILES[0])}"
    if block_m == STAGED_BLOCK_ROWS and (latent % STAGED_K_MULTIPLE or inter % STAGED_K_MULTIPLE):
        return (f"{STAGED_BLOCK_ROWS}-row blocks need L = {latent} and I = {inter} to be multiples of "
                f"{STAGED_K_MULTIPLE} (whole rounds of the staged kernels' 4-stage rings of 64-wide steps; one rule "
                "for every kernel of these blocks, which the staged_kernel override may pick)")
    return None


def split_reason(split: tuple[int, int], latent: int, inter: int) -> str | None:
    """Why the kernels cannot cut K (L1: L, L2: I) into these (L1, L2) slices (None if they can)."""
    for name, n, k in (("L1", split[0], latent), ("L2", split[1], inter)):
        if n < 1 or k % (n * STEP_K):
            return f"{name} K = {k} does not cut into {n} slices of whole {STEP_K}-wide steps"
    return None


def _rings(name: str, value: Any) -> tuple[str, str]:
    names = _per_kernel(value)
    if len(names) != 2 or any(n not in WEIGHT_RINGS for n in names):
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(WEIGHT_RINGS)}, or two of them as L1,L2")
    return names


tuning.register(RING_OVERRIDE, _rings)
tuning.register(LOAD_ORDER_OVERRIDE, tuning.choice(LOAD_ORDERS))


def weight_rings(num_pairs: int, block_m: int = 32) -> tuple[str, str]:
    """How L1 and L2 bring their weight words (WEIGHT_RINGS): the mxfp4_ring override replaces the measured choice
    (default_rings), with one name for both kernels or "L1,L2"."""
    return tuning.current().mxfp4_ring or default_rings(num_pairs, block_m)


def load_order() -> str:
    """The TMA ring's load order (LOAD_ORDERS): the mxfp4_load_order override, "auto" when None."""
    return tuning.current().mxfp4_load_order or "auto"


def ring_for(ring: str, k_steps: int, split: int) -> str:
    """The ring a kernel call takes: a ring loop runs whole rounds of its stages (unrolled, one allocation per
    stage), so a K range that is no multiple of them takes the loads; so do K slices (a single token's few
    programs: regs_split), where L1's TMA ring needs 146 registers here. A tree that rebased the ring to the
    slice and ran slices on the rings was slower at every M than whole K (docs/design/routed-decode.md)."""
    if ring not in WEIGHT_RINGS:
        raise ValueError(f"unknown weight ring {ring!r}: expected one of {', '.join(WEIGHT_RINGS)}")
    return ring if split == 1 and k_steps % max(WEIGHT_RINGS[ring][1], 1) == 0 else "loads"


def _words_descriptor(words: torch.Tensor, rows: int, ring: str, dual: bool, swizzle: int = 0):
    """TMA descriptor of the weight words for the "tma" ring, one k step of `rows` rows per box:
    [2E, I, K / 8] int32 with the gate and up tiles in one box (dual, L1), else [E * N, K / 8]; swizzle: the
    stages' swizzle in bytes (the FP8 kernels': FP8_WORDS_SWIZZLE)."""
    if ring != "tma":
        return None
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if dual:
        view = words.view(words.shape[0] * 2, words.shape[1] // 2, words.shape[2])
        block = [2, rows, STEP_K // 8]
    else:
        view = words.view(-1, words.shape[-1])
        block = [rows, STEP_K // 8]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=view.dim())
    return TensorDescriptor(view, list(view.shape), list(view.stride()), block, layout)


def step_descriptor(words: torch.Tensor, gated: bool, rows: int, step_k: int):
    """TMA descriptor of one k step of a program's `rows` weight rows (the staged and W4A8 prefill kernels): [2E, I,
    K / 8] int32 with rows / 2 gate rows and the same columns' up rows in one box (L1, gated), else [E * N, K / 8];
    step_k / 8 words a row, no swizzle."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if gated:
        view = words.view(words.shape[0] * 2, words.shape[1] // 2, words.shape[2])
        block = [2, rows // 2, step_k // 8]
    else:
        view = words.view(-1, words.shape[-1])
        block = [rows, step_k // 8]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=view.dim())
    return TensorDescriptor(view, list(view.shape), list(view.stride()), block, layout)


def activation_rows_descriptor(rows: torch.Tensor, box_cols: int):
    """TMA descriptor of [128, box_cols] boxes of bf16 activation rows in the wgmma's 128-byte swizzle (the B operand
    of the 128-row blocks' kernels: the kappa kernels' 128-wide k steps, the warp-specialised L2's 64-wide ones)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [STAGED_BLOCK_ROWS, box_cols], layout)


# Both launched as a pair by routed/kappa_path.py: "kappa" runs the MMA with N by the block's valid rows in tiers
# (16, 32, 64, 64 + 16, 64 + 32, 128), "kappa_plain" with N = 64 or 128 (docs/design/prefill.md, "MMA tiers").
KAPPA_KERNELS = ("kappa", "kappa_plain")
STAGED_KERNELS = (*KAPPA_KERNELS, "staged", "ws")
STAGED_KERNEL_OVERRIDE = "staged_kernel"  # tuning override
tuning.register(STAGED_KERNEL_OVERRIDE, tuning.choice(STAGED_KERNELS, "the kernels of the 128-row prefill blocks"))
DEFAULT_STAGED_KERNEL = "kappa"
# What the plan prints for each (routed_plan: the staged_kernel decision); docs/design/prefill.md has the numbers.
STAGED_KERNEL_REASONS = {
    "kappa": "weights dequantised into the wgmma's register operand, activations in kappa order by TMA "
             "(1.24-1.33x the staged kernels on the H200 at M = 4096 .. 32768), the MMA's N by each block's valid "
             "rows in tiers (16, 32, 64, 64 + 16, 64 + 32, 128)",
    "kappa_plain": "staged_kernel override: the kappa kernels with the MMA's N 64 or 128 only (no tiers by valid rows)",
    "staged": "staged_kernel override: weights dequantised into shared memory, both wgmma operands from there",
    "ws": "staged_kernel override: warp-specialised persistent form of the staged kernels (0.78-0.84x them)",
}


def staged_kernel() -> str:
    """Which kernels run the 128-row blocks: "kappa" (routed_kappa.py, the default) or "kappa_plain" (the same
    without MMA tiers), "staged" (routed_staged.py) or "ws" (routed_staged_ws.py); the staged_kernel tuning override
    picks."""
    return tuning.current().staged_kernel or DEFAULT_STAGED_KERNEL


def launch_routed_l1(
    z: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, act: torch.Tensor, num_blocks: int, block_m: int, top_k: int, beta: float,
    lin_beta: float, split: int = 1, signal: bool = False, ring: str | None = None, staged: str | None = None,
) -> None:
    """act[block rows, :I] = bf16(SiTU(gate, up)) for every routed block (rows of unused blocks untouched).
    split > 1: K in that many slices of FP32 partial sums, then the ordered-sum + SiTU finish.
    signal: L1 lets its dependents launch at once and the finish goes out as a programmatic dependent
    (ops/common/pdl.py), so that a dependent L2 launched next can prefetch its weights while L1 runs.
    ring: how the weight words arrive (WEIGHT_RINGS; None: weight_rings()). 128-row blocks take the staged kernel or
    its warp-specialised form, `staged` ("staged" / "ws"; None: the staged_kernel override, which must then name one
    of them: the kappa kernels launch from kappa_path), with a ring of its own, whole K and no signal."""
    from ..split_k_finish import launch_l1_finish
    from .routed_gemm import l1_regs_kernel

    if block_m == STAGED_BLOCK_ROWS:
        if split != 1 or signal:
            raise ValueError(f"{STAGED_BLOCK_ROWS}-row blocks run whole K without programmatic dependents "
                             f"(split = {split}, signal = {signal}): K slices and PDL are for decode blocks")
        from .staged_launch import launch_staged_l1

        launch_staged_l1(z, w13, w13_scale, sorted_pairs, block_expert, act, num_blocks, top_k, beta, lin_beta,
                         staged or staged_kernel())
        return

    latent = z.shape[1]
    inter = w13.shape[1] // 2
    words = w13.view(torch.int32)
    n_rows = num_blocks * block_m
    h_part = act if split == 1 else torch.empty(split, n_rows, 2 * inter, dtype=torch.float32, device=z.device)
    grid = (num_blocks * (inter // (16 * L1_WARPS)) * split,)
    ring = ring_for(weight_rings(z.shape[0] * top_k, block_m)[0] if ring is None else ring, latent // split // STEP_K,
                    split)
    kind, stages = WEIGHT_RINGS[ring]
    l1_regs_kernel[grid](
        z, words, w13_scale, sorted_pairs, block_expert, act, h_part, n_rows, inter, latent, latent // 8,
        latent // MXFP4_BLOCK, top_k, words.stride(0), w13_scale.stride(0), float(beta), float(lin_beta),
        _words_descriptor(words, 16 * L1_WARPS, ring, dual=True),
        BM=block_m, BK=STEP_K, SPLIT=split, num_warps=L1_WARPS, SIGNAL=signal, RING=kind, STAGES=stages,
        ORDER=load_order(), maxnreg=max_registers("l1", kind, block_m),
    )
    if split > 1:
        launch_l1_finish(h_part, block_expert, act, n_rows, inter, h_part, act, 0, inter, beta, lin_beta, block_m,
                         split, False, pdl=signal)


def launch_routed_l2(
    act: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor, pairs: torch.Tensor, num_blocks: int, block_m: int, dependent: bool = False,
    ring: str | None = None, staged: str | None = None,
) -> None:
    """pairs[pair, :] = act[row] @ W2[e]^T in FP32 for every valid (token, slot) row; pairs [SPLIT, P, L]
    holds one K slice's sums per leading index (the combine adds them in order).
    dependent: launch as a programmatic dependent of the kernel just before it on the stream, which must
    be launch_routed_l1's with signal=True (its L1 or finish): the grouping must have finished before.
    128-row blocks take the staged kernel or its warp-specialised form, as launch_routed_l1 (whole K, not dependent)."""
    from .routed_gemm import l2_regs_kernel

    if block_m == STAGED_BLOCK_ROWS:
        if dependent or pairs.dim() == 3:
            raise ValueError(f"{STAGED_BLOCK_ROWS}-row blocks run whole K as an ordinary launch (dependent = "
                             f"{dependent}, pairs {tuple(pairs.shape)}): K slices and PDL are for decode blocks")
        from .staged_launch import launch_staged_l2

        launch_staged_l2(act, w2, w2_scale, sorted_pairs, block_expert, pairs, num_blocks, staged or staged_kernel())
        return

    latent = w2.shape[1]
    inter = act.shape[1]
    words = w2.view(torch.int32)
    split = pairs.shape[0] if pairs.dim() == 3 else 1
    grid = (num_blocks * (latent // (16 * L2_WARPS)) * split,)
    ring = ring_for(weight_rings(pairs.shape[-2], block_m)[1] if ring is None else ring, inter // split // STEP_K, split)
    kind, stages = WEIGHT_RINGS[ring]
    l2_regs_kernel[grid](
        act, words, w2_scale, sorted_pairs, block_expert, pairs, pairs.stride(0) if split > 1 else 0, latent, inter,
        inter // 8, inter // MXFP4_BLOCK, words.stride(0), w2_scale.stride(0), _words_descriptor(words, 16 * L2_WARPS, ring, dual=False),
        BM=block_m, BK=STEP_K, SPLIT=split, num_warps=L2_WARPS, PDL=dependent, launch_pdl=dependent, RING=kind,
        STAGES=stages, ORDER=load_order(), maxnreg=max_registers("l2", kind, block_m),
    )


def _check_fp8(k: int, block_m: int, n: int, rows: int, mma: str) -> None:
    from .fp8_mainloop import MMA_SCHEDULES

    if block_m not in FP8_BLOCK_ROWS or k % FP8_K_MULTIPLE or n % rows:
        raise ValueError(f"the FP8 kernels take blocks of {FP8_BLOCK_ROWS} rows (got {block_m}), K = {k} a multiple "
                         f"of {FP8_K_MULTIPLE} and N = {n} of {rows}")
    if mma not in MMA_SCHEDULES:
        raise ValueError(f"mma={mma!r}: the FP8 kernels schedule their MMAs as one of {MMA_SCHEDULES}")


def launch_routed_l1_fp8(
    z_hi: torch.Tensor, z_lo: torch.Tensor, col_factor: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
    sorted_pairs: torch.Tensor, block_expert: torch.Tensor, act: torch.Tensor, num_blocks: int, block_m: int,
    top_k: int, beta: float, lin_beta: float, mma: str = "pipe", maxnreg: int | None = None,
) -> None:
    """act[block rows, :I] = bf16(SiTU(gate, up)) on FP8 MMAs (routed_fp8.py; not bitwise the bf16 path):
    z_hi, z_lo, col_factor from ops.routed.fp8_split.split_e4m3(z) (or its kernel, routed/triton/fp8_split_kernel.py).
    mma: how a step schedules its MMAs and waits (fp8_mainloop._step_mmas); maxnreg: a register cap (tuning)."""
    from .routed_fp8 import l1_fp8_kernel

    latent, inter = z_hi.shape[1], w13.shape[1] // 2
    _check_fp8(latent, block_m, inter, 16 * L1_WARPS, mma)
    desc = _words_descriptor(w13.view(torch.int32), 16 * L1_WARPS, "tma", True, FP8_WORDS_SWIZZLE)
    grid = (num_blocks * (inter // (16 * L1_WARPS)),)
    l1_fp8_kernel[grid](
        z_hi, z_lo, col_factor, w13_scale, sorted_pairs, block_expert, act, inter, latent, latent // MXFP4_BLOCK,
        top_k, w13_scale.stride(0), float(beta), float(lin_beta), desc, BM=block_m, BK=STEP_K, num_warps=L1_WARPS,
        MMA=mma, maxnreg=maxnreg,
    )


def launch_routed_l2_fp8(
    a_hi: torch.Tensor, a_lo: torch.Tensor, row_factor: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    sorted_pairs: torch.Tensor, block_expert: torch.Tensor, pairs: torch.Tensor, num_blocks: int, block_m: int,
    mma: str = "pipe",
) -> None:
    """pairs[pair, :] = act[row] @ W2[e]^T in FP32 on FP8 MMAs for every valid row (routed_fp8.py; LMF_ROUTED_FP8=l1,l2): a_hi,
    a_lo, row_factor the split of L1's act rows (routed/triton/fp8_split_kernel.launch_split_e4m3(act))."""
    from .routed_fp8 import l2_fp8_kernel

    latent, inter = w2.shape[1], a_hi.shape[1]
    _check_fp8(inter, block_m, latent, 16 * L2_WARPS, mma)
    desc = _words_descriptor(w2.view(torch.int32), 16 * L2_WARPS, "tma", False, FP8_WORDS_SWIZZLE)
    grid = (num_blocks * (latent // (16 * L2_WARPS)),)
    l2_fp8_kernel[grid](
        a_hi, a_lo, row_factor, w2_scale, sorted_pairs, block_expert, pairs, latent, inter, inter // MXFP4_BLOCK,
        w2_scale.stride(0), desc, BM=block_m, BK=STEP_K, num_warps=L2_WARPS, MMA=mma,
    )
