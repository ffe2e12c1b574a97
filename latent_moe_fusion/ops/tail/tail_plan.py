"""Which tail kernel runs for a shape, and why: lmf::latent_tail's choice from sizes and a device description alone.

plan_tail walks the op's decisions by calling the functions that make them, on meta tensors of the op's shapes: the
registry's rule (backends.first_runnable: a forced backend, else priority order), each backend's availability
(available_on) and shape checks (the Triton tail's supports; the CuTe tail's rank_supports with its measured M
buckets), then the chosen backend's configuration (the Triton tail's table_config, fit_split_k, pick_config,
gemv_block_sizes, launch_grid, uses_descriptors and _frag_group; the CuTe tail's pick_config). So the plan cannot
disagree with what runs. What the runtime reads from the device (capability, SM count) or the installation (the CuTe
DSL) is given and listed in TailPlan.assumptions; the switches (LMF_BACKEND*, TRITON_INTERPRET, the tuning overrides)
are read here as the op reads them: the plan answers for this process's environment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from latent_moe_fusion import tuning

from ..common.backends import Backend, Reason, backends_for, device_reason, first_runnable, forced_backend_name
from ..common.fragment_layouts import MODES, fragment_shape, rank_operands
from ..common.input_checks import ACTIVATION_DTYPES
from ..common.pdl import site_enabled, use_pdl_on
from ..common.plan_lines import Decision, plan_lines
from ..common.tail_gemm.tail_gemm_configs import GEMV_MAX_M, TailConfig, gemv_override, pick_config, table_config
from ..common.tail_gemm.tail_gemv import gemv_block_sizes
from ..common.tail_gemm.tail_launch import _dot_mode, _frag_group, _prefetch_steps, launch_grid, uses_descriptors
from .cute import tail_backend as cute_tail
from .cute.tail_configs import CuteTailConfig, bucket_bound
from .cute.tail_configs import pick_config as cute_pick_config
from .cute.tail_runtime import target_arch
from .triton import triton_tail_backend as triton_tail

OP = "latent_tail"
LAYOUTS = {
    "local": "ws [1, M, H]: the shared expert's output (R = 1)",
    "hidden_scatter": "ws [R, M, H/R]: ws[r] is rank r's partial, this rank's columns",
    "token_publish": "ws [M, R, H]: ws[t, r] is rank r's partial of this rank's token t",
}


@dataclass(frozen=True)
class TailPlan:
    num_tokens: int  # M: tokens of the tail's output on this rank (token_publish: this rank's share)
    hidden: int
    latent: int
    mode: str
    world_size: int
    capability: tuple[int, int] | None  # None: no CUDA device (the reference runs)
    backend: str  # what select_backend picks: "cute" | "triton" | "reference" | another registered backend
    backend_reasons: tuple[tuple[str, str | None], ...]  # every backend in priority order, why it cannot run (None)
    config: TailConfig | CuteTailConfig | None  # the chosen backend's launch config (None: no kernel of ours)
    kernel: str  # the kernel launched (the reference: the PyTorch math)
    grid: tuple[int, ...] | None  # the Triton launch grid (None for the other backends)
    fragments: tuple[int, int, int]  # ws on this rank
    num_fragments: int  # R: fragments summed into each output element in the epilogue
    columns: int  # N: the hidden columns this rank computes
    frag_group: int | None  # Triton: fragments loaded together in the epilogue
    pdl: bool  # launched as a programmatic dependent of the kernel before it
    decisions: tuple[Decision, ...]  # one line per choice, with its reason
    assumptions: tuple[str, ...]

    def lines(self) -> list[str]:
        return plan_lines(self.decisions, self.assumptions)


def shape_problem(num_tokens: int, hidden: int, latent: int, mode: str, world_size: int,
                  dtype: torch.dtype = torch.bfloat16) -> str | None:
    """What makes these sizes no call of the op (None: they make one); plan_tail and the CLI check with it."""
    if mode not in MODES:
        return f"mode must be one of {', '.join(MODES)}, got {mode!r}"
    if min(num_tokens, hidden, latent, world_size) < 1:
        return f"sizes must be >= 1, got M = {num_tokens}, H = {hidden}, L = {latent}, world size = {world_size}"
    if mode == "local" and world_size != 1:
        return f"mode 'local' is one rank; world size {world_size} needs hidden_scatter (TP) or token_publish (SP)"
    if hidden % world_size:
        return f"hidden size {hidden} is not divisible by the world size {world_size}"
    if dtype not in ACTIVATION_DTYPES:
        return f"dtype {dtype} is not an activation dtype of the op ({', '.join(map(str, ACTIVATION_DTYPES))})"
    return None


def plan_tail(
    num_tokens: int, hidden: int = 7168, latent: int = 3584, dtype: torch.dtype = torch.bfloat16,
    mode: str = "local", world_size: int = 1, capability: tuple[int, int] | None = (9, 0), num_sms: int = 132,
    cute_installed: bool | None = None, overrides: Mapping[str, Any] | None = None,
) -> TailPlan:
    """What lmf::latent_tail runs on one rank for num_tokens output tokens of Kimi K3's sizes (H, L) by default, in
    `mode` over world_size ranks, on a device of this capability with num_sms SMs (the H200's 132 by default).
    cute_installed: whether the CuTe DSL is installed there (None: as in this environment); overrides: tuning
    overrides in force (tuning.overrides)."""
    problem = shape_problem(num_tokens, hidden, latent, mode, world_size, dtype)
    if problem is not None:
        raise ValueError(f"plan_tail: {problem}")
    if num_sms < 1:
        raise ValueError(f"plan_tail: num_sms must be >= 1, got {num_sms}")
    given = cute_installed is not None
    with tuning.overrides(**dict(overrides or {})):
        return _plan(num_tokens, hidden, latent, dtype, mode, world_size, capability, num_sms,
                     cute_tail.installed() if cute_installed is None else cute_installed, given)


def _plan(
    m: int, hidden: int, latent: int, dtype: torch.dtype, mode: str, world: int, capability: tuple[int, int] | None,
    num_sms: int, cute_installed: bool, installed_given: bool,
) -> TailPlan:
    decisions: list[Decision] = []

    def decide(name: str, value: Any, reason: str) -> None:
        decisions.append(Decision(name, str(value), reason))

    y_n = torch.empty(m, latent, dtype=dtype, device="meta")
    w_up = torch.empty(hidden, latent, dtype=dtype, device="meta")
    ws = torch.empty(fragment_shape(mode, m, hidden, world), dtype=dtype, device="meta")
    y, w, frags = rank_operands(y_n, w_up, ws, mode, world, rank=0)
    r, _, n = frags.shape
    decide("tokens", f"M={m}", _tokens_reason(mode, m, n, world))
    decide("fragments", f"R={r} x [M={m}, N={n}], {r * m * n * dtype.itemsize / 2**20:.2f} MiB read in the epilogue",
           f"{LAYOUTS[mode]}; read as [R, M, N] with strides {tuple(frags.stride())} (fragments_as_rmn)")

    device_type = "cpu" if capability is None else "cuda"
    reason_of = _reasons(device_type, capability, cute_installed, (y_n, w_up, ws, mode), (y, w, frags))
    registered = backends_for(OP)
    reasons = {b.name: reason_of(b) for b in registered}
    chosen = first_runnable(OP, lambda b: reasons[b.name], device_type).name
    forced = forced_backend_name(OP)
    order = ", ".join(f"{b.name} {b.priority}" for b in registered)
    decide("backend", chosen, f"forced (LMF_BACKEND / LMF_BACKEND_LATENT_TAIL={forced})" if forced == chosen else
           f"the first in priority order ({order}) that can run the call (select_backend)")
    for b in registered:
        why = reasons[b.name]
        decide(b.name, "can run" if why is None else "cannot run", why or _able_reason(b.name, m, forced))

    config: TailConfig | CuteTailConfig | None = None
    grid = frag_group = None
    pdl = False
    if chosen == triton_tail.NAME:
        config, kernel, grid, frag_group, pdl = _triton_decisions(decide, y, w, r, capability, num_sms)
    elif chosen == cute_tail.NAME:
        config = cute_pick_config(m)
        kernel = "TailKernelSm90"
        pdl = use_pdl_on("tail", capability)
        _cute_decisions(decide, config, m, r, pdl)
    else:
        kernel = "tail_math (PyTorch)"
        decide("kernel", kernel, "no fused kernel: fp32 matmul, the fragments added in order r = 0..R-1, one rounding "
                                 "(reference_math.tail_math)")
    if mode == "hidden_scatter":
        decide("gather", f"{world} x [M, {n}] -> [M, {hidden}]", "gather_columns: torch.distributed all-gather"
               if chosen == "reference" else "gather_columns: peer writes where prepare_symmetric_exchange made a "
                                             "workspace, else a torch.distributed all-gather")
    cap_text = "none (CPU)" if capability is None else f"sm_{capability[0]}{capability[1]}, {num_sms} SMs"
    decide("device", cap_text, "given; switches (LMF_BACKEND*, TRITON_INTERPRET, tuning overrides) read from this "
                               "process")

    assumptions = [
        "y_n, w_up and ws contiguous in the op's layouts, 16-byte aligned (else: no descriptor loads; the CuTe tail "
        "refuses)",
        f"CuTe DSL {'installed' if cute_installed else 'not installed'} "
        f"({'given' if installed_given else 'as in this environment'})",
    ]
    if chosen == triton_tail.NAME:
        assumptions.append(f"{num_sms} SMs (given; the Triton tail reads the device's count: fit_split_k, persistent "
                           "grids)")
    if mode == "hidden_scatter" and world > 1:
        assumptions.append("rank 0's rows of w_up (every rank's slice has the same shape)")
    return TailPlan(m, hidden, latent, mode, world, capability, chosen, tuple(reasons.items()), config, kernel, grid,
                    tuple(ws.shape), r, n, frag_group, pdl, tuple(decisions), tuple(assumptions))


def _reasons(device_type: str, capability: tuple[int, int] | None, cute_installed: bool, args: tuple,
             rank_args: tuple) -> Callable[[Backend], Reason]:
    """backends._reason for a device of this capability: availability from each backend's available_on; backends
    the plan does not know (the reference) depend on neither the device nor the group: their own checks."""

    def reason_of(backend: Backend) -> Reason:
        reason = device_reason(backend, device_type)
        if reason is not None:
            return reason
        if backend.name == triton_tail.NAME:
            return triton_tail.available_on(capability) or triton_tail.supports(*args)
        if backend.name == cute_tail.NAME:
            return cute_tail.available_on(capability, cute_installed) or cute_tail.rank_supports(*rank_args)
        return backend.available() or backend.supports(*args)

    return reason_of


def _tokens_reason(mode: str, m: int, n: int, world: int) -> str:
    if mode == "hidden_scatter":
        return f"TP over {world} ranks: this rank computes {n} columns (q*{n}..) of all {m} tokens, then all-gathers"
    if mode == "token_publish":
        return f"SP over {world} ranks: this rank's {m} of the {world * m} rank-major tokens, every hidden column"
    return "one rank: every hidden column of the M tokens"


def _able_reason(name: str, m: int, forced: str | None) -> str:
    if name == cute_tail.NAME:
        if forced == cute_tail.NAME:
            return "installed, sm_90, shapes fit; forced, so the measured table is not consulted"
        return (f"installed, sm_90, shapes fit; {cute_tail.DEFAULT_CHOICE.name} (measured_choice) picks cute for the "
                f"{_bucket(m)} bucket")
    if name == triton_tail.NAME:
        return "sm_90 or newer, dtype served, the launcher takes the shape (launch_reason)"
    return "available, takes these arguments"


def _triton_decisions(decide: Callable[[str, Any, str], None], y: torch.Tensor, w: torch.Tensor, r: int,
                      capability: tuple[int, int] | None, num_sms: int):
    """The Triton tail's launch as tail_fused makes it: (config, kernel, grid, fragment group, pdl)."""
    m, k = y.shape
    n = w.shape[0]
    fp32 = y.dtype == torch.float32
    table = table_config(m, fp32)
    config = pick_config(m, n, k, fp32, num_sms)
    if not fp32 and m <= GEMV_MAX_M and gemv_override() is not None:
        why = "the tail_gemv tuning override: 'off' gives the swap-AB kernel back, a spec sets the GEMV's"
    elif config.kernel == "gemv":
        why = f"table_config: the CUDA-core GEMV serves M <= GEMV_MAX_M = {GEMV_MAX_M} (a weight stream)"
    else:
        why = f"table_config: the {'FP32' if fp32 else 'BF16'}_TABLE bucket holding M = {m}"
    decide("config", table.label(), why)

    grid = launch_grid(config, m, n, num_sms)
    if config.kernel.startswith("swap"):
        if config.split_k != table.split_k:
            why = (f"fit_split_k: {grid[0]} N tiles x {table.split_k} covered under half of {num_sms} SMs: raised to "
                   f"{config.split_k}")
        else:
            why = f"the table's; fit_split_k keeps it ({grid[0]} N tiles x {config.split_k}, {num_sms} SMs, K = {k})"
    else:
        why = "whole K: split-K serves the swap-AB kernels only"
    decide("split_k", config.split_k, why)

    descriptors = uses_descriptors(config, y, w)
    if config.kernel == "gemv":
        kernel = "tail_gemv_kernel"
        block_m, block_k, preload_k = gemv_block_sizes(m, config.block_k, config.preload_k, k)
        decide("kernel", f"{kernel} {config.label()}", "CUDA cores: M FMAs per weight element beside its HBM traffic")
        decide("tiles", f"BLOCK_N={config.block_n} rows, BLOCK_M={block_m}, BLOCK_K={block_k}, PRELOAD_K={preload_k}, "
                        f"warps={config.num_warps}, stages={config.num_stages}",
               "gemv_block_sizes: M padded to a power of two, the K step and preload shrunk as M grows")
    else:
        family = "swap" if config.kernel.startswith("swap") else "tile"
        kernel = f"tail_{family}{'_tma' if descriptors else ''}_kernel"
        decide("kernel", f"{kernel} {config.label()}", "descriptor loads (uses_descriptors: a _tma config, aligned "
               "row-major operands)" if descriptors else "pointer loads (a config without descriptors)")
        if family == "swap":
            decide("tiles", f"BLOCK_N={config.block_n} hidden rows x BLOCK_M={config.block_m} tokens x "
                            f"BLOCK_K={config.block_k}, warps={config.num_warps}, stages={config.num_stages}",
                   f"swap-AB: the weight rows fill the MMA's wide side, M = {m} padded to {config.block_m}")
        else:
            decide("tiles", f"BM={config.block_m} BN={config.block_n} BK={config.block_k}, warps={config.num_warps}, "
                            f"stages={config.num_stages}, group_m={config.group_m}, persistent={config.persistent}",
                   "output tiles in grouped order: GROUP_M row tiles share W tiles from L2")
    dims = " x ".join(map(str, grid))
    decide("grid", f"{dims} programs", "launch_grid: " + ("one program per BLOCK_N weight rows" if config.kernel ==
           "gemv" else "(N tiles, K slices)" if config.kernel.startswith("swap") else
           "one program per SM over the tiles" if config.persistent else "one program per output tile"))
    if config.kernel.startswith("swap") and config.split_k > 1:
        decide("workspace", f"fp32 partials [{config.split_k}, {m}, {n}] = "
                            f"{config.split_k * m * n * 4 / 2**20:.2f} MiB, {grid[0]} arrival counters",
               "split-K: the last program of an N tile sums the partials in order s = 0..SPLIT_K-1")
    frag_group = _frag_group(config, r)
    decide("epilogue", f"{_fragments(r)}, {frag_group} in flight", "_frag_group: the largest divisor of R whose loads "
           "fit ~64 registers beside the accumulator; added in order r = 0..R-1, one rounding")
    cast, precision = _dot_mode(y.dtype)
    if fp32 or cast:
        decide("dots", precision + (" on fp32 casts" if cast else ""), "_dot_mode: exact fp32 dots for fp32 inputs "
               "and under the interpreter (TRITON_INTERPRET)")
    pdl = config.kernel in ("gemv", "swap", "swap_tma") and use_pdl_on("tail", capability)
    if pdl and config.kernel == "gemv":
        why = "loads its first PRELOAD_K weight columns, then waits for the combine before it"
    elif pdl and not descriptors:
        why = f"prefetches {_prefetch_steps(w, k, config.block_k)} K steps of its weight rows to L2, then waits"
    elif pdl:
        why = "waits for the kernel before it"
    else:
        why = _no_pdl_reason(config.kernel.startswith("tile"))
    decide("pdl", pdl, why)
    return config, kernel, grid, frag_group, pdl


def _fragments(r: int) -> str:
    return f"{r} fragment{'' if r == 1 else 's'}"


def _bucket(m: int) -> str:
    """The CuTe tail's M bucket of m, as the measured table keys it."""
    bound = bucket_bound(m)
    return f"M <= {bound}" if bound < 1 << 62 else "unbounded (prefill)"


def _no_pdl_reason(prefill: bool) -> str:
    if prefill:
        return "prefill tiles launch plainly (PDL serves the decode kernels)"
    if not site_enabled("tail"):
        return "the pdl_sites override leaves the tail site off"
    return "needs sm_90 or newer, compiled (not the interpreter)"


def _cute_decisions(decide: Callable[[str, Any, str], None], config: CuteTailConfig, m: int, r: int,
                    pdl: bool) -> None:
    decide("kernel", f"TailKernelSm90 {config.label()}", f"tail_configs.pick_config: the {_bucket(m)} bucket; "
                                                         f"compiled for {target_arch()} (warmup() before capture)")
    decide("tiles", f"{config.hidden_per_tile} hidden x {config.tokens_per_tile} tokens per CTA, "
                    f"{config.warpgroups} warpgroup(s), {config.stages} stages, {config.smem_bytes()} B shared memory",
           "swap-AB: the weight rows fill WGMMA's 64-wide M slot, the tokens its N slot" if config.swap_ab else
           "prefill: 128x128 tiles, few enough stages that two CTAs share an SM")
    decide("epilogue", _fragments(r), "added to the fp32 accumulator in order r = 0..R-1, one rounding")
    decide("pdl", pdl, "loads the weight tiles of its first ring stages, then waits" if pdl else
           _no_pdl_reason(False))
