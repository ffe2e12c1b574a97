"""Tuning and A/B overrides of the ops' measured choices (kernel configs, launch orders, placements): one typed,
frozen `TuningOverrides`, set in code for a `with` block, for benchmarks and experiments.

    from latent_moe_fusion import tuning

    with tuning.overrides(prefill_regs=32, mxfp4_ring=("tma", "cp4")):
        out = compiled_block(x)          # the ops read tuning.current() when they run

None in a field is the measured default. Each value is checked when the block is entered (`TuningOverrides` runs
the parser the reading module registered, so a bad value raises there, naming the field and what it takes) and
normalised (text forms such as "1", "2,4" or "16x128" are accepted, for command lines). The overrides live in a
contextvars.ContextVar: they are read when an op runs, in the thread that entered the block, which is where
torch.compile'd graphs call the custom ops and where CUDA graphs are captured (a graph replays what it captured).
Blocks nest; an inner block changes only the fields it names. Where a choice is cached (the producer's resolved
config), the cache key holds the override values that choice reads. Overrides do not cross thread or process
boundaries (unlike environment variables, a spawned rank does not inherit them): set them where the ops run.

An operator's settings (kill switch, forced backends, numerics, symmetric exchange) are environment variables
instead: latent_moe_fusion/envs.py. docs/switches.md lists both.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

Parser = Callable[[str, Any], Any]  # (field name, value given) -> normalised value; raises ValueError naming both


@dataclass(frozen=True)
class Knob:
    """What one override field is, for people (docs/switches.md)."""

    values: str
    default: str  # what None (the measured default) does
    effect: str
    read_in: str  # the module (relative to latent_moe_fusion/) that reads it and registers its parser


def _knob(values: str, default: str, effect: str, read_in: str) -> Any:
    return field(default=None, metadata={"knob": Knob(values, default, effect, read_in)})


@dataclass(frozen=True)
class TuningOverrides:
    """One field per tuning knob; None everywhere is the library's measured behaviour."""

    # Launches and the latent tail.
    pdl_sites: tuple[str, ...] | str | bool | None = _knob(
        "Sites `tail` and `routed`, as a sequence or a comma list; `all` / `1` / True for both; `none` / `0` / "
        "False / empty for none.",
        "Both sites.",
        "Which decode kernels launch as programmatic dependents (sm_90+, not under TRITON_INTERPRET). `tail` covers "
        "the latent tail's decode kernels (Triton and CuTe: they load weights before they wait) and the combine's "
        "early signal. `routed` covers a single token's K-split chain L1, L1 finish, L2, which runs only with "
        "`routed_gemv=False`. Outputs are bitwise equal to PDL off (docs/results.md).",
        "ops/common/pdl.py")
    tail_prefetch: int | str | None = _knob(
        "A count of K steps, at least 0.",
        "2",
        "How many K steps of each weight row the dependent (PDL) swap-AB decode tail kernel sends to L2 before it "
        "waits; `0` sends none. Acts only when that kernel launches with PDL, with aligned weights and whole K "
        "steps. L2 prefetch only.",
        "ops/common/tail_gemm/tail_launch.py")
    tail_gemv: str | None = _knob(
        "`off`, or `ROWSxKxPRELOAD[wWARPS][sSTAGES]`, e.g. `4x512x1024w2s1`: rows, a K step of at least 16, warps "
        "and a non-zero preload are powers of two; stages 1 to 8.",
        "The CUDA-core GEMV `4x512x1024` with 1 warp and 1 stage.",
        "The Triton tail's kernel for up to 2 bf16 tokens. `off` gives back the swap-AB kernel "
        "(`swap:16x64x128/w4/st5/s2`); a shape sets another GEMV, where an omitted `w` means 4 warps and an omitted "
        "`s` 1 stage. Each config sums in its own fixed order: deterministic, but another config may differ in the "
        "last bits.",
        "ops/common/tail_gemm/tail_gemm_configs.py")
    cute_tail_choice: str | os.PathLike | None = _knob(
        "A path to an existing JSON file `{\"choice\": {\"<bucket bound M>\": \"cute\" or \"triton\"}}` "
        "(bench/tail_cute.py writes them).",
        "The table the package ships, `ops/tail/cute/tail_choice.json` (a copy of the measured "
        "`bench/results/tail_cute_choice.json`, kept equal by a test): CuTe for M = 3 to 64; Triton for M up to 2, "
        "65 to 128 and prefill.",
        "Which M buckets of `lmf::latent_tail` the CuTe tail (sm_90, nvidia-cutlass-dsl) takes ahead of Triton. It "
        "plays no part when a tail backend is forced. Each file is parsed once per process.",
        "ops/tail/cute/tail_backend.py")
    # The latent down-projection beside the router.
    down_projection_kernel: str | None = _knob(
        "A swap-kernel label `KERNEL:BMxBNxBK/wWARPS/stSTAGES/sSPLIT` with KERNEL `swap` or `swap_tma`, e.g. "
        "`swap_tma:16x32x256/w4/st6/s1`. Sizes are powers of two, blocks at least 16, stages 1 to 8.",
        "The measured table of `LMF_DOWN_PROJECTION=triton`.",
        "The Triton kernel of the latent down-projection where `LMF_DOWN_PROJECTION` is `triton` (the default): "
        "the label's kernel serves up to BM tokens, cuBLAS beyond. No effect with `LMF_DOWN_PROJECTION=cublas`.",
        "ops/routed/router_fused/down_projection.py")
    router_overlap_streams: bool | str | None = _knob(
        "True / `1`, False / `0`.",
        "Two streams up to 64 tokens, one stream beyond.",
        "Applies in `lmf::route_and_project`, and in `lmf::route_and_produce` when the shared-first schedule is not "
        "taken, on CUDA. True always runs the down-projection on a side stream beside the router chain; False "
        "never does. The same calls run either way, so outputs are bitwise equal. (Whether the pass inserts the op "
        "at all is `FusionConfig.overlap_router`.)",
        "ops/routed/router_fused/route_and_project.py")
    router_overlap_order: str | None = _knob(
        "`router`, `down`",
        "`router`",
        "When the router chain and the down-projection run side by side, which is launched first (`down`: the "
        "down-projection, on the side stream). Both branches fork first, so only the launch order changes.",
        "ops/routed/router_fused/route_and_project.py")
    # lmf::route_and_produce's shared-first schedule.
    shared_first_schedule: bool | str | None = _knob(
        "True / `1`, False / `0`.",
        "On for 5 to 128 tokens.",
        "Applies in `lmf::route_and_produce` on CUDA, with MXFP4 routed weights and the Triton producer. True always "
        "starts the shared expert (cuBLAS) first on its own stream, beside the router and the down-projection; False "
        "runs the two ops in a row. Bitwise the two ops from 5 tokens on. Forced below 5 tokens, cuBLAS replaces the "
        "producer's Triton shared grids, which sum in another order. (Whether the pass inserts the op at all is "
        "`FusionConfig.shared_first`.)",
        "ops/routed/router_fused/route_and_produce.py")
    shared_first_order: tuple[str, str, str] | str | None = _knob(
        "Each of `shared`, `router`, `down` once, as a sequence or comma-separated, e.g. `router,shared,down`.",
        "`router,shared,down` up to 32 tokens, `shared,router,down` beyond.",
        "The launch order of the shared-first schedule's three branches. Every side stream forks before any of "
        "them, and the kernels are the same, so only the order on the GPU changes.",
        "ops/routed/router_fused/route_and_produce.py")
    shared_first_urgent: str | None = _knob(
        "`none`, `route`, `all`",
        "`all` up to 8 tokens, `none` beyond.",
        "Which shared-first branches go on high-priority streams. `route` covers the router chain and the "
        "down-projection; `all` adds the routed experts. Scheduling only: the GPU tests found outputs bitwise equal "
        "under every urgency.",
        "ops/routed/router_fused/route_and_produce.py")
    # The producer's schedule and the shared expert's placement.
    group_first: bool | str | None = _knob(
        "True / `1`, False / `0`.",
        "Grouping before the shared expert's side-stream fork from 2 tokens on, after the fork for 1 token.",
        "Acts only beside the register-dequant routed kernels (the Triton grids always group first). True launches "
        "the expert grouping before the fork, False after it. Launch order only.",
        "ops/routed/schedule_rules.py")
    regs_shared: str | None = _knob(
        "`side`, `cublas`, `cublas_side`",
        "By shared tokens: `side` up to 4, `cublas_side` up to 16, `cublas` beyond.",
        "Where the producer runs the shared expert beside the register-dequant or GEMV routed kernels: Triton grids "
        "on a side stream, cuBLAS in line after the routed L1 launch, or cuBLAS on the side stream. The Triton grids "
        "sum in other orders than cuBLAS (not bitwise); `cublas` and `cublas_side` run the same GEMMs.",
        "ops/routed/schedule_rules.py")
    grid_shared: str | None = _knob(
        "`grid`, `cublas`",
        "`grid` up to 256 shared tokens, `cublas` beyond.",
        "Where the producer runs the shared expert when the routed tiles are on the Triton grids: inside them (one "
        "launch per layer) or as cuBLAS GEMMs between them. Other kernels, other summation order.",
        "ops/routed/schedule_rules.py")
    shared_in_line: str | None = _knob(
        "`first`, `after_l1`",
        "`first` from 257 shared tokens on, `after_l1` below.",
        "Where the producer launches its in-line cuBLAS shared GEMMs (`cublas` placement): before the routed "
        "grouping, or right after the routed L1 launch. The same kernels on one stream give the same bits.",
        "ops/routed/schedule_rules.py")
    # The producer's configs (ProducerConfig; part of its memo key).
    prefill_regs: int | str | None = _knob(
        "`0`, `16`, `32`, `64`, `128`, `choice`",
        "By rows per expert r = pairs / min(E, pairs), counting every pair as local: 32-row register-dequant blocks "
        "up to r = 128, 64-row blocks up to 512, 128-row staged blocks beyond.",
        "Applies to MXFP4 on sm_90 where the decode blocks end (the decode grouping would take 64-row blocks, or "
        "more than 4096 pairs). `0` takes the Triton tiles, and `16` to `128` take those blocks at any such size "
        "(`128` is the staged kernels). `choice` is the policy from before the staged kernels: 32-row blocks up to "
        "r = 128, 64-row up to 4096, and beyond that a per-call GPU choice between 64-row blocks and the Triton "
        "tiles. Gluon vs Triton tiles is ~1e-4, not bitwise; staged vs register-dequant is not the same bits; "
        "64-row vs 32-row blocks is bitwise.",
        "ops/routed/producer_config.py")
    regs_split: tuple[int, int] | str | None = _knob(
        "`L1,L2`: two integers of at least 1, as a pair or text, e.g. `2,4`.",
        "`4,2` up to 16 pairs (one top-16 token), `1,1` beyond.",
        "The K slices of the register-dequant routed L1 and L2, at any size when set. FP32 slice sums are added in "
        "slice order. A split that does not cut K into whole 128-wide steps falls back to `1,1`, and any split "
        "other than `1,1` keeps the FP8 L1 off.",
        "ops/routed/producer_config.py")
    producer_decode_shared_tiles: tuple[int, int] | str | None = _knob(
        "`ROWSxK`, as a pair or text, powers of two of at least 16, e.g. `16x128`.",
        "`32x64`; `32x128` beside the register-dequant kernels for up to 16 pairs or the GEMV's tokens.",
        "The (rows, K) tile of the shared expert's gate/up programs in the Triton grids of the MXFP4 decode configs "
        "(up to 4096 pairs).",
        "ops/routed/producer_config.py")
    producer_shared_split: int | str | None = _knob(
        "A power of two of at least 1.",
        "4 (up to 16 pairs, or 33 to 64 GEMV pairs), 8 (17 to 32 pairs).",
        "The K slices of the shared gate/up in the Triton grids beside the register-dequant kernels, only for a "
        "single token or the GEMV's tokens (otherwise unsplit).",
        "ops/routed/producer_config.py")
    producer_shared_l2_rows: int | str | None = _knob(
        "A power of two of at least 16.",
        "64",
        "Weight rows per program of the shared expert's down GEMM in the Triton grids beside the register-dequant "
        "kernels (MXFP4 decode).",
        "ops/routed/producer_config.py")
    producer_shared_l2_k: int | str | None = _knob(
        "A power of two of at least 16.",
        "64 for a single token or the GEMV's tokens, 32 otherwise.",
        "The K tile of those shared down programs.",
        "ops/routed/producer_config.py")
    # The routed MXFP4 kernels.
    routed_gemv: bool | str | None = _knob(
        "False / `0`, True / `1`, or a shape `L1ROWSxL2ROWSxWORDS[wWARPS][pPAIRS][b][f][rREGS]`, e.g. `4x4x64w1p2`: "
        "powers of two, WORDS at least 4, REGS 24 to 255. `b`: bf16x2 scaling; `f`: L2 prefetch. An omitted `w` or "
        "`p` takes 1 or 2; an omitted `r` means no register cap.",
        "On up to 64 pairs (pairs = tokens x top_k, so four top-16 tokens), with `2x2x64w1p2r80`.",
        "Runs the routed MXFP4 experts of a few decode tokens (sm_90 register-dequant path) on CUDA-core GEMV "
        "kernels instead of the grouped MMA kernels. False turns it off; True or a shape turns it on at every decode "
        "size the GEMV can take (up to 1024 pairs). FP32 sums in a fixed order: bitwise deterministic.",
        "ops/routed/routed_gemv.py")
    mxfp4_regs: bool | str | None = _knob(
        "True / `1`, False / `0`.",
        "On, wherever the kernels can run.",
        "False moves the routed MXFP4 experts off the sm_90 Gluon kernels (register-dequant, staged, routed GEMV "
        "and FP8) onto the Triton tiles, at decode and prefill sizes. Not bitwise the same: the Gluon kernels are "
        "~1e-4 rel. L2 from the Triton tiles (docs/results.md).",
        "ops/routed/gluon/__init__.py")
    mxfp4_ring: tuple[str, str] | str | None = _knob(
        "One of `loads`, `cp2`, `cp4`, `tma` for both kernels, or two as `L1,L2` (a pair or text), e.g. `tma,cp4`.",
        "L1: `tma`. L2: `tma` up to 2048 pairs or in 64-row blocks, `cp4` beyond.",
        "How the register-dequant kernels bring in their weight words: 16-byte loads one step ahead, or a "
        "shared-memory ring filled by cp.async (1 or 3 steps ahead) or by TMA. K slices, and a K that is not a "
        "whole number of ring rounds, take the loads. All give the same bits.",
        "ops/routed/gluon/__init__.py")
    staged_kernel: str | None = _knob(
        "`kappa`, `kappa_plain`, `staged`, `ws`",
        "`kappa` (1.24-1.33x `staged` on the routed op at M = 4096 .. 32768 on the H200).",
        "Which kernels run the 128-row prefill blocks of MXFP4 experts on sm_90 (BF16 activations): `kappa` (the "
        "weights dequantised into the wgmma's register operand, the activations in kappa order by TMA, L1's rows "
        "gathered first; the MMA's N by each block's valid rows: 16, 32, 64, 64 + 16, 64 + 32 or 128), "
        "`kappa_plain` (the same with N = 64 or 128 only; 0.92x `kappa` at M = 4096, within 2 % beyond), `staged` "
        "(the weights dequantised into shared memory, both operands from there) or `ws` (the staged kernels "
        "warp-specialised and persistent: loader, dequantiser and MMA warps over mbarrier rings; 0.78-0.84x "
        "`staged`). `staged` and `ws` give the same bits, `kappa` and `kappa_plain` too; the kappa kernels sum k "
        "in another order (rel. L2 ~1e-4 from the staged ones).",
        "ops/routed/gluon/__init__.py")
    w4a8_rows: str | None = _knob(
        "`64`, `128`",
        "`128` (1.25-1.30x faster than 64 on the H200).",
        "Weight rows per program of the opt-in W4A8 prefill kernels (LMF_ROUTED_W4A8): 128 (one CTA per SM) or 64 "
        "(two CTAs of 8 warps per SM, 128 registers). Bitwise the same output.",
        "ops/routed/w4a8_path.py")
    mxfp4_load_order: str | None = _knob(
        "`auto`, `early`, `late`",
        "`auto`: late for 32-row MMAs, early for 16-row ones.",
        "When the TMA ring's step issues the next step's scales and activation tile: before its stage wait (early) "
        "or after its barrier (late). Bitwise equal (docs/results.md).",
        "ops/routed/gluon/__init__.py")
    mxfp4_maxnreg: tuple[int | str, int | str] | int | str | None = _knob(
        "`L1,L2` (a pair or text), or one value for both. Each is a register count from 24 to 255, `none` "
        "(uncapped) or `auto`.",
        "`auto`: L1 uncapped on the TMA ring and 128 on the other rings, L2 80; 64-row blocks uncapped.",
        "The register caps (ptxas maxnreg) of the register-dequant L1 and L2 kernels.",
        "ops/routed/gluon/__init__.py")
    # DeepGEMM.
    deepgemm_routed_layout: str | None = _knob(
        "`masked`, `contiguous`",
        "By M: masked up to 128 tokens, contiguous beyond.",
        "Which layout of DeepGEMM's sm_90 BF16 M-grouped GEMMs the opt-in `deepgemm` backend of "
        "`lmf::routed_experts` uses. It acts only when that backend is forced by `LMF_BACKEND_ROUTED_EXPERTS` or "
        "`LMF_BACKEND`.",
        "ops/routed/deepgemm/sm90_grouped.py")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _parse(f.name, value))

    def active(self) -> dict[str, Any]:
        """The fields set (not None), in declaration order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


NAMES = tuple(f.name for f in fields(TuningOverrides))
_PARSERS: dict[str, Parser] = {}
NO_OVERRIDES = TuningOverrides()  # frozen: safe to share as the default
_ACTIVE: contextvars.ContextVar[TuningOverrides] = contextvars.ContextVar("latent_moe_fusion.tuning",
                                                                            default=NO_OVERRIDES)


def knobs() -> dict[str, Knob]:
    """Every override field's description, in declaration order."""
    return {f.name: f.metadata["knob"] for f in fields(TuningOverrides)}


def register(name: str, parse: Parser) -> Parser:
    """Called by the module that reads `name`, at import: `parse` checks and normalises a value given for it."""
    if name not in NAMES:
        raise ValueError(f"{name!r} is no TuningOverrides field: declare it in latent_moe_fusion/tuning.py first")
    _PARSERS[name] = parse
    return parse


def _parse(name: str, value: Any) -> Any:
    parse = _PARSERS.get(name)
    if parse is None:  # its reading module registers it at import, and importing the package imports every one
        raise RuntimeError(f"the tuning override {name} has no parser: `import latent_moe_fusion` before setting it "
                           f"(latent_moe_fusion/{knobs()[name].read_in} registers it)")
    return parse(name, value)


def current() -> TuningOverrides:
    """The overrides in force here (all None outside any `overrides` block)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def overrides(**changes: Any) -> Iterator[TuningOverrides]:
    """Set these fields of the current overrides for the block (None: back to the measured default). A value a
    field does not take raises ValueError here, naming the field and what it takes."""
    unknown = sorted(set(changes) - set(NAMES))
    if unknown:
        raise TypeError(f"unknown tuning override(s) {', '.join(unknown)}: expected some of {', '.join(NAMES)}")
    token = _ACTIVE.set(dataclasses.replace(current(), **changes))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


# Parsers for the common shapes of value; each refuses anything else, naming the field and what it takes.

def switch(on: str, off: str) -> Parser:
    """True / 1 / "1" or False / 0 / "0"; `on` / `off` say what each does, for the error."""

    def parse(name: str, value: Any) -> bool:
        if value in (True, False, "1", "0") and not isinstance(value, float):
            return value in (True, "1")
        raise ValueError(f"{name}={value!r}: expected True / 1 ({on}), False / 0 ({off}) or None (the measured "
                         "default)")

    return parse


def choice(words: Sequence[str], meaning: str = "") -> Parser:
    """One of `words`; `meaning` goes into the error."""

    def parse(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in words:
            what = f" ({meaning})" if meaning else ""
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(words)}{what} or None")
        return value

    return parse


def permutation(items: Sequence[str], what: str = "the items") -> Parser:
    """Every one of `items` once, in the order given: a sequence or a comma-separated text."""

    def parse(name: str, value: Any) -> tuple[str, ...]:
        order = tuple(v.strip() for v in value.split(",")) if isinstance(value, str) else tuple(value)
        if sorted(order) != sorted(items):
            raise ValueError(f"{name}={value!r}: expected {what} {', '.join(items)}, each once, comma-separated, "
                             "or None")
        return order

    return parse


def whole_number(value: Any) -> int | None:
    """An int (not a bool) or the digits of one, else None: for the parsers of numeric fields."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def power_of_two(low: int) -> Parser:
    """A power of two >= low (an int or its digits)."""

    def parse(name: str, value: Any) -> int:
        n = whole_number(value)
        if n is None or n < low or n & (n - 1):
            raise ValueError(f"{name}={value!r}: expected a power of two >= {low}")
        return n

    return parse


def pair(value: Any, sep: str) -> tuple[Any, ...]:
    """A text "A<sep>B" split (each part stripped), a list or tuple as a tuple, anything else alone: for the parsers
    of paired fields, which check the parts and their count."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(sep))
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
