"""The Triton kernels of `lmf::latent_tail` and their launcher: up-projection + fragment sum + add, one kernel.
Shared: the tail's Triton backend (tail/triton/triton_tail_backend.py) and the latent down-projection
(routed/router_fused/down_projection.py, R = 0) both run them.

`tail_fused(a, w, frags)` is the launcher: out [M, N] = round(((a @ w^T) + frags[0]) + ... + frags[R-1])
for any strided [R, M, N] fragment view. The backend maps the three layouts onto it (token_publish:
ws.transpose(0, 1); hidden_scatter: this rank's rows of w_up, then layouts.gather_columns).

Decode launches go out as programmatic dependents where ops/common/pdl.py allows (site "tail"): the swap-AB
kernel prefetches its first weight steps to L2, the GEMV (one or two tokens) loads its first weight
columns into registers, and both then wait for the producer's combine, which signals early.

`plan_launch` is what a launch will do (its config, split and whether it can run at all) from the sizes alone:
the Triton backend's supports() asks it too, so the two cannot disagree. Offsets past int32 are no reason to refuse:
where some tensor reaches past them the launch sets the kernels' LARGE_OFFSETS (int64 offsets; element_offsets.py).

Capture safety: a launch does no host sync and allocates only with torch.empty (the output and, for
split-K configs, the fp32 partials). Split-K arrival counters are one int32 per N tile, kept per
device and reset to zero by the kernel itself; they are created outside capture by `warmup()` (or
the first eager call). Two split-K tails must not run concurrently on one device (they would share
counters); a call under capture that finds no counters gets fresh zeroed ones (a memset node).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from latent_moe_fusion import envs, tuning

from ..device_capability import sm_count
from ..element_offsets import needs_int64_offsets
from ..pdl import use_pdl
from .tail_gemm_configs import BF16_TABLE, FP32_TABLE, TailConfig, pick_config

try:
    from .tail_gemv import gemv_block_sizes, tail_gemv_kernel
    from .tail_kernels import tail_swap_kernel, tail_swap_tma_kernel, tail_tile_kernel, tail_tile_tma_kernel

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the installation
    _IMPORT_ERROR = f"triton is not importable ({exc})"

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_COUNTER_SLOTS = 1 << 14


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpreting() -> bool:
    return envs.read("TRITON_INTERPRET")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return sm_count(device)


# Split-K arrival counters are shared by every launch on a device, so two split-K launches must never run at
# once on the same slots: each user that can run beside the tail (the down-projection, on a side stream)
# takes its own half.
COUNTER_USERS = ("tail", "down_projection")


def _allocated_outside_graph_pools(device: torch.device) -> torch.Tensor:
    """The counters, zeroed, in the device's ordinary memory. The first call can come inside a cudagraph tree's
    warm-up (torch.compile mode="reduce-overhead"), which sends every allocation of its thread to the tree's pool:
    a tensor cached from there is one the tree does not track, and it refuses to record ("tensor(s) in the
    cudagraph pool not tracked as outputs"). Another thread's allocation goes to the ordinary pool; that thread
    waits for its zero fill, so the counters are ready on any stream."""
    made: list[torch.Tensor] = []

    def allocate() -> None:
        made.append(torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type != "cuda":
        allocate()
    else:
        worker = threading.Thread(target=allocate)
        worker.start()
        worker.join()
        if not made:
            raise RuntimeError(f"could not allocate the split-K counters on {device} (see the error above)")
    return made[0]


def _counters_reason(tiles: int, user: str) -> str | None:
    slots = _COUNTER_SLOTS // len(COUNTER_USERS)
    if tiles > slots:
        return f"split-K {user} with {tiles} N tiles exceeds its {slots} counters; use a larger block_n"
    return None


def _counters(device: torch.device, tiles: int, user: str = "tail") -> torch.Tensor:
    reason = _counters_reason(tiles, user)
    if reason is not None:
        raise ValueError(reason)
    slots = _COUNTER_SLOTS // len(COUNTER_USERS)
    cached = _COUNTERS.get(device)
    if cached is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            cached = torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=device)  # graph-private: not cached
        else:
            cached = _COUNTERS[device] = _allocated_outside_graph_pools(device)
    start = COUNTER_USERS.index(user) * slots
    return cached[start:start + slots]


def _dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(cast operands to fp32, input_precision): exact fp32 dots for fp32 inputs and under the interpreter."""
    interp = _interpreting()
    return interp, ("ieee" if dtype == torch.float32 or interp else "tf32")


def _tma_ok(a: torch.Tensor, w: torch.Tensor) -> bool:
    # Descriptors need unit inner stride and 16-byte aligned bases and row strides.
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, w)
    )


def uses_descriptors(config: TailConfig, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a launch of `config` reads a and w through tensor descriptors (a _tma kernel on operands that allow)."""
    return config.kernel.endswith("_tma") and _tma_ok(a, w)


PREFETCH_OVERRIDE = "tail_prefetch"  # tuning override of TAIL_PREFETCH_STEPS (benchmarks)
TAIL_PREFETCH_STEPS = 2  # K steps of each weight row sent to L2 before a dependent decode tail waits (H200, M = 1:
# 2 steps best of 0 / 2 / 4 / 7 / 14, whole slices slowest; docs/design/decode-schedule.md)


def _prefetch_steps(w: torch.Tensor, k: int, block_k: int) -> int:
    """K steps of every weight row the PDL swap kernel prefetches: rows must be contiguous along K with
    16-byte aligned starts and whole K steps (the prefetch then never runs past a row)."""
    aligned = w.stride(1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0
    if not aligned or k % block_k or (block_k * w.element_size()) % 16:
        return 0
    forced = tuning.current().tail_prefetch
    return TAIL_PREFETCH_STEPS if forced is None else forced


def _prefetch_count(name: str, value: Any) -> int:
    steps = tuning.whole_number(value)
    if steps is None or steps < 0:
        raise ValueError(f"{name}={value!r}: expected a count of K steps >= 0")
    return steps


tuning.register(PREFETCH_OVERRIDE, _prefetch_count)


def _frag_group(config: TailConfig, r: int) -> int:
    """Fragments loaded together in the epilogue: the largest divisor of R whose loads fit in ~64 registers."""
    regs_per_fragment = max(1, config.block_m * config.block_n // (64 * config.num_warps))  # bf16, 2 per register
    return max((g for g in range(1, r + 1) if r % g == 0 and (g == 1 or g * regs_per_fragment <= 64)), default=1)


def launch_grid(config: TailConfig, m: int, n: int, num_sms: int) -> tuple[int, ...]:
    """The grid a launch of `config` runs for out [M, N]: the GEMV one program per BLOCK_N rows; swap-AB (N tiles,
    K slices); tiles one program per output tile, or one per SM looping over them (persistent)."""
    if config.kernel == "gemv":
        return (_cdiv(n, config.block_n),)
    if config.kernel.startswith("swap"):
        return (_cdiv(n, config.block_n), config.split_k)
    tiles = _cdiv(m, config.block_m) * _cdiv(n, config.block_n)
    return (min(tiles, num_sms) if config.persistent else tiles,)


@dataclass(frozen=True)
class TailLaunch:
    """What tail_fused launches for out [M, N] = a [M, K] @ w [N, K]^T + fragments (plan_launch)."""
    config: TailConfig
    split_k: int  # K slices of a swap kernel; > 1: fp32 partials [split_k, M, N] and one counter per N tile
    reason: str | None  # why it cannot launch (None: it can)


def plan_launch(m: int, n: int, k: int, fp32: bool, num_sms: int, config: TailConfig | None = None,
                counter_user: str = "tail") -> TailLaunch:
    """The launch tail_fused makes for these sizes (config None: the table's, split-K fitted to num_sms)."""
    if config is None:
        config = pick_config(m, n, k, fp32, num_sms)
    split = config.split_k if config.kernel in ("swap", "swap_tma") else 1
    reason = None
    if config.kernel in ("gemv", "swap", "swap_tma") and config.block_m < m:
        reason = f"config {config.label()} does not serve M = {m} (its kernel takes M <= {config.block_m})"
    elif split > 1:
        reason = _counters_reason(_cdiv(n, config.block_n), counter_user)
    return TailLaunch(config, split, reason)


def launch_reason(a: torch.Tensor, w: torch.Tensor, frags: torch.Tensor) -> str | None:
    """Why tail_fused cannot take a [M, K], w [N, K], frags [R, M, N] (None: it can), from shapes alone (meta and
    fake tensors serve). A symbolic M (a graph compiled for any batch) is checked at every bucket's largest M: the
    answer then holds for each, and no guard on M is made."""
    m, k = a.shape
    n = w.shape[0]
    fp32 = a.dtype == torch.float32
    sizes = (m,) if isinstance(m, int) else tuple(bound for bound, _ in (FP32_TABLE if fp32 else BF16_TABLE))
    num_sms = _num_sms(a.device)
    return next((r for size in sizes if (r := plan_launch(size, n, k, fp32, num_sms).reason) is not None), None)


def launch_gemv(a: torch.Tensor, w: torch.Tensor, frags: torch.Tensor, out: torch.Tensor, config: TailConfig,
                pdl: bool, large_offsets: bool = False) -> torch.Tensor:
    """out = round(((a @ w^T) + frags[0]) + ...) by the CUDA-core GEMV (tail_gemv.py) for the M <= config.block_m
    that plan_launch lets through. pdl: launch as a programmatic dependent (the kernel waits for its predecessor
    after loading its first weights). large_offsets: int64 element offsets."""
    m, k = a.shape
    n = w.shape[0]
    block_m, block_k, preload_k = gemv_block_sizes(m, config.block_k, config.preload_k, k)
    tail_gemv_kernel[launch_grid(config, m, n, _num_sms(a.device))](
        a, w, frags, out, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), *frags.stride(), *out.stride(),
        R=frags.shape[0], BLOCK_N=config.block_n, BLOCK_M=block_m, BLOCK_K=block_k, PRELOAD_K=preload_k,
        STAGES=config.num_stages, EVEN_K=(k - preload_k) % block_k == 0, FRAG_GROUP=_frag_group(config, frags.shape[0]),
        PDL=pdl, LARGE_OFFSETS=large_offsets, num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out


def tail_fused(
    a: torch.Tensor,
    w: torch.Tensor,
    frags: torch.Tensor,
    out: torch.Tensor | None = None,
    config: TailConfig | None = None,
    pdl: bool | None = None,
    counter_user: str = "tail",
) -> torch.Tensor:
    """out [M, N] = round(((a @ w^T) + frags[0]) + ... + frags[R-1]); a [M, K], w [N, K], frags [R, M, N].

    R may be 0 (a plain matmul, e.g. the down-projection). pdl: launch as a programmatic dependent (None: the
    `tail` site of the pdl_sites override decides). counter_user: whose split-K counters (one of COUNTER_USERS) it uses."""
    m, k = a.shape
    n = w.shape[0]
    r = frags.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    plan = plan_launch(m, n, k, a.dtype == torch.float32, _num_sms(a.device), config, counter_user)
    if plan.reason is not None:
        raise ValueError(plan.reason)
    config = plan.config
    if config.kernel == "gemv":  # no dot operands or strides to prepare: launch_gemv takes the tensors
        return launch_gemv(a, w, frags, out, config, pdl=use_pdl("tail", a.device) if pdl is None else pdl,
                           large_offsets=needs_int64_offsets(a, w, frags, out))
    dot_fp32, precision = _dot_mode(a.dtype)
    frag_strides = frags.stride()
    out_strides = out.stride()
    if config.kernel in ("swap", "swap_tma"):
        grid = launch_grid(config, m, n, _num_sms(a.device))
        tiles, split = grid[0], plan.split_k
        steps_per_split = _cdiv(_cdiv(k, config.block_k), split)
        if split > 1:
            part = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
            counters = _counters(a.device, tiles, counter_user)
        else:
            part, counters = out, out  # unused by the SPLIT_K == 1 specialisation
        if pdl is None:
            pdl = use_pdl("tail", a.device)
        meta = dict(
            R=r, BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k, SPLIT_K=split,
            FRAG_GROUP=_frag_group(config, r), DOT_FP32=dot_fp32, PRECISION=precision,
            LARGE_OFFSETS=needs_int64_offsets(a, w, frags, out, part),
            num_warps=config.num_warps, num_stages=config.num_stages, PDL=pdl, launch_pdl=pdl,
        )
        if uses_descriptors(config, a, w):
            from triton.tools.tensor_descriptor import TensorDescriptor

            a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
            w_desc = TensorDescriptor.from_tensor(w, [config.block_n, config.block_k])
            tail_swap_tma_kernel[grid](
                a_desc, w_desc, frags, out, part, counters, m, n, k, steps_per_split, *frag_strides, *out_strides,
                **meta,
            )
            return out
        tail_swap_kernel[grid](
            a, w, frags, out, part, counters,
            m, n, k, steps_per_split,
            a.stride(0), a.stride(1), w.stride(0), w.stride(1), *frag_strides, *out_strides,
            EVEN_K=k % config.block_k == 0, PREFETCH_STEPS=_prefetch_steps(w, k, config.block_k) if pdl else 0, **meta,
        )
        return out
    grid = launch_grid(config, m, n, _num_sms(a.device))
    common = dict(
        R=r, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        FRAG_GROUP=_frag_group(config, r), FLATTEN=config.persistent, DOT_FP32=dot_fp32, PRECISION=precision,
        LARGE_OFFSETS=needs_int64_offsets(a, w, frags, out), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if uses_descriptors(config, a, w):
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(w, [config.block_n, config.block_k])
        tail_tile_tma_kernel[grid](a_desc, w_desc, frags, out, m, n, k, *frag_strides, *out_strides, **common)
        return out
    tail_tile_kernel[grid](
        a, w, frags, out, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), *frag_strides, *out_strides,
        EVEN_K=k % config.block_k == 0, **common,
    )
    return out


def warmup(
    m_values: tuple[int, ...] = (1, 2, 16, 32, 64, 128, 256),
    n: int = 7168,
    k: int = 3584,
    r_values: tuple[int, ...] = (1, 8),
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
) -> None:
    """Compile every bucket's kernel for these sizes and create the split-K counters (call before capture)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _counters(device, 1)
    w = torch.randn(n, k, dtype=dtype, device=device)
    for m in m_values:
        a = torch.randn(m, k, dtype=dtype, device=device)
        for r in r_values:
            tail_fused(a, w, torch.randn(r, m, n, dtype=dtype, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
