"""Compile cache, warm-up and launch of the CuTe DSL tail kernel (imports cutlass on first use only).

One compiled kernel per (arch, dtype, R, tile config, PDL or not); M, N, K and all strides are run-time
arguments, so a decode bucket's kernel serves every M of the bucket and any weight shape.
Compiling takes seconds, so it never happens implicitly under CUDA-graph capture: `warmup()`
compiles and loads ahead, and a launch under capture that would need a compile raises
`CuteCompileDuringCapture` instead. Launches go to torch's current stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from latent_moe_fusion import envs

from ...common.pdl import device_supports_pdl, use_pdl
from .tail_configs import CuteTailConfig, all_configs, pick_config

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_ARCH = "sm_90a"  # WGMMA and setmaxnreg need the arch-specific target


class CuteCompileDuringCapture(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelKey:
    arch: str
    dtype: torch.dtype
    num_frags: int
    cfg: CuteTailConfig
    pdl: bool = False  # launched as a programmatic dependent (tail_kernel.py; ops/common/pdl.py's "tail" site)


_COMPILED: dict[KernelKey, Any] = {}
_LOADED: dict[tuple[KernelKey, int], Any] = {}  # (key, device index) -> executor with its module loaded
_LOCK = threading.Lock()


def target_arch() -> str:
    """The compile target: CUTE_DSL_ARCH if set (CPU cross-compiles), else sm_90a."""
    return envs.read("CUTE_DSL_ARCH") or DEFAULT_ARCH


def _cutlass_dtype(dtype: torch.dtype):
    import cutlass

    if dtype == torch.bfloat16:
        return cutlass.BFloat16
    if dtype == torch.float16:
        return cutlass.Float16
    raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES} for the CuTe tail, got {dtype}")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def compile_kernel(key: KernelKey, keep_ptx: bool = False) -> Any:
    """Compile (no GPU needed) the kernel of `key`; cached. keep_ptx also writes the PTX into the cwd."""
    with _LOCK:
        if key in _COMPILED and not keep_ptx:
            return _COMPILED[key]
        if _capturing():
            raise CuteCompileDuringCapture(
                f"the CuTe tail kernel {key.cfg.label()} (R = {key.num_frags}, {key.dtype}, {key.arch}) is not "
                "compiled and a CUDA graph is being captured: call "
                "latent_moe_fusion.ops.tail.cute.warmup(...) with these sizes before capturing"
            )
        import cutlass
        import cutlass.cute as cute
        from cuda.bindings import driver
        from cutlass.cute.runtime import make_ptr

        from .tail_kernel import TailKernelSm90

        dtype = _cutlass_dtype(key.dtype)
        kernel = TailKernelSm90(key.cfg, dtype, key.num_frags, key.pdl)
        ptrs = [make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=16) for _ in range(4)]
        sizes = [cutlass.Int32(0)] * 8
        options = f"--gpu-arch {key.arch}" + (" --keep-ptx" if keep_ptx else "")
        # A stream handle is only a value here (the null stream); launches pass torch's current one.
        compiled = cute.compile(kernel, *ptrs, *sizes, driver.CUstream(0), options=options)
        _COMPILED[key] = compiled
        return compiled


def _loaded(key: KernelKey, device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    run = _LOADED.get((key, index))
    if run is not None:
        return run
    if _capturing():
        raise CuteCompileDuringCapture(
            f"the CuTe tail kernel {key.cfg.label()} (R = {key.num_frags}, {key.dtype}) is not loaded on cuda:{index} "
            "and a CUDA graph is being captured: call latent_moe_fusion.ops.tail.cute.warmup(...) before capturing"
        )
    compiled = compile_kernel(key)
    with torch.cuda.device(index):
        run = compiled.to(index)
    with _LOCK:
        _LOADED[(key, index)] = run
    return run


def key_for(m: int, dtype: torch.dtype, num_frags: int, cfg: CuteTailConfig | None = None,
            pdl: bool = False) -> KernelKey:
    return KernelKey(target_arch(), dtype, num_frags, cfg if cfg is not None else pick_config(m), pdl)


def tail_cute_fused(
    y: torch.Tensor,
    w: torch.Tensor,
    frags: torch.Tensor,
    out: torch.Tensor | None = None,
    cfg: CuteTailConfig | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """out [M, N] = round(((y @ w^T) + frags[0]) + ... + frags[R-1]); y [M, K], w [N, K], frags [R, M, N].

    The caller checks shapes and strides (backend `supports`); this launches on the current stream.
    pdl: launch as a programmatic dependent (default: ops/common/pdl.py's "tail" site, the pdl_sites override).
    """
    m, k = y.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=y.dtype, device=y.device)
    if m == 0:
        return out
    from cuda.bindings import driver
    from cutlass.cute import AddressSpace
    from cutlass.cute.runtime import make_ptr

    if pdl is None:
        pdl = use_pdl("tail", y.device)
    key = key_for(m, y.dtype, frags.shape[0], cfg, pdl)
    run = _loaded(key, y.device)
    dtype = _cutlass_dtype(y.dtype)

    def ptr(t: torch.Tensor):
        return make_ptr(dtype, t.data_ptr(), AddressSpace.gmem, assumed_align=16)

    stream = driver.CUstream(torch.cuda.current_stream(y.device).cuda_stream)
    run(
        ptr(y), ptr(w), ptr(frags), ptr(out),
        m, n, k, y.stride(0), w.stride(0), frags.stride(0), frags.stride(1), out.stride(0),
        stream,
    )
    return out


def warmup(
    m_values: Iterable[int] | None = None,
    num_frags: Iterable[int] = (1,),
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = "cuda",
) -> list[KernelKey]:
    """Compile (and, on a CUDA device, load) the kernels serving these M values; call before graph capture.

    m_values None means every bucket. device None only compiles (CPU machines). Both launch forms are
    prepared where PDL can run (the pdl_sites override is read per launch), else the plain one.
    """
    cfgs = all_configs() if m_values is None else tuple(dict.fromkeys(pick_config(m) for m in m_values))
    on_cuda = device is not None and torch.device(device).type == "cuda"
    forms = (False, True) if device is None or (on_cuda and device_supports_pdl(torch.device(device))) else (False,)
    keys = [KernelKey(target_arch(), dtype, r, cfg, pdl) for r in num_frags for cfg in cfgs for pdl in forms]
    for key in keys:
        compile_kernel(key)
        if on_cuda:
            _loaded(key, torch.device(device))
    return keys


def is_ready(key: KernelKey, device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (key, index) in _LOADED
