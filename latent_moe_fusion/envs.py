"""Every environment variable latent_moe_fusion reads, declared once: how its value is parsed, its default, what it
changes, which module reads it and who sets it. Package code reads them through `read` (nothing else touches
os.environ); tests/test_envs.py keeps the declarations and the read sites in step, and docs/switches.md is generated
from here:

    python -m latent_moe_fusion switches --markdown > docs/switches.md

The variables are an operator's: the kill switch, forced backends, the id check, numerics choices and the symmetric
exchange. Benchmarks' tuning and A/B knobs are not environment variables but tuning overrides
(latent_moe_fusion/tuning.py), set in code for a `with` block. Values are read per call unless an entry says
otherwise, so a change applies to the next call (a CUDA graph replays what it captured).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

OPERATOR = "operator"  # set by whoever deploys the ops
DEVELOPER = "developer"  # another tool's variable that the package also consults

Parser = Callable[[str, str], Any]  # (variable name, non-empty raw value) -> value; raises ValueError naming both


@dataclass(frozen=True)
class EnvVar:
    name: str  # a family's name holds a placeholder: LMF_BACKEND_<OP>
    parse: Parser
    default: Any  # what read() returns when the variable is unset or empty
    values: str  # what it accepts, for people
    unset: str  # what happens when it is unset
    effect: str  # what it changes
    read_in: tuple[str, ...]  # modules (relative to latent_moe_fusion/) that read it
    audience: str = OPERATOR
    read_when: str = "per call"
    # A family (LMF_BACKEND_<OP>): any name with this prefix; members are the names it takes today (docs, tests).
    prefix: str = ""
    members: tuple[str, ...] = ()


# Parsers: each refuses an unknown value the same way, naming the variable and what it accepts.

def switch(on: str, off: str) -> Parser:
    """1 or 0; `on` / `off` say what each does, for the error."""

    def parse(name: str, raw: str) -> bool:
        if raw not in ("0", "1"):
            raise ValueError(f"{name}={raw!r}: expected 1 ({on}), 0 ({off}) or unset")
        return raw == "1"

    return parse


def choice(words: Sequence[str], meaning: str = "") -> Parser:
    """One of `words`, as given; `meaning` goes into the error."""

    def parse(name: str, raw: str) -> str:
        if raw not in words:
            what = f" ({meaning})" if meaning else ""
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(words)}{what} or unset")
        return raw

    return parse


def folded_choice(words: Sequence[str], default: str) -> Parser:
    """One of `words`, case and surrounding spaces ignored (all spaces: `default`)."""

    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower() or default
        if value not in words:
            raise ValueError(f"{name}={value!r}: expected one of {tuple(words)}")
        return value

    return parse


def lenient_flag(name: str, raw: str) -> bool:
    """Any value: empty, 0, false, no, off (case and spaces ignored) are False, anything else True. Never raises:
    a kill switch must not be the thing that fails."""
    return raw.strip().lower() not in ("", "0", "false", "no", "off")


def triton_flag(name: str, raw: str) -> bool:
    """As Triton reads its own boolean variables (triton.knobs: 1, true or on, case ignored)."""
    return raw.lower() in ("1", "true", "on")


def text(name: str, raw: str) -> str:
    return raw


def down_projection_kernel(name: str, raw: str) -> str:
    if raw not in ("cublas", "triton"):
        hint = (f"; a swap-kernel label is a tuning override: latent_moe_fusion.tuning.overrides("
                f"down_projection_kernel={raw!r})") if ":" in raw else ""
        raise ValueError(f"{name}={raw!r}: expected cublas or triton, or unset{hint}")
    return raw


ROUTED_FP8_WORDS = ("0", "1", "l1,l2")
# The ops with backends (ops/common/backends.py registers them as their modules import; a test keeps this list equal).
BACKEND_OPS = ("routed_experts", "moe_shared_producer", "latent_tail", "noaux_tc_route", "route_and_project",
               "route_and_produce", "route_gather_and_produce")

_DECLARED = (
    EnvVar(
        "LMF_DISABLE_FUSION", lenient_flag, False,
        values="Any value. Empty, `0`, `false`, `no`, `off` (case and spaces ignored) leave fusion on; anything else "
               "turns it off (lenient: no ValueError).",
        unset="Fusion on.",
        effect="Makes `LatentMoEFusionPass` rewrite nothing: every block and router chain stays unfused, and its report "
               "gives the reason. All-gathered when the pass is built, so one rank setting it disables fusion on every "
               "rank.",
        read_in=("fusion_pass/capabilities.py",),
        read_when="once, when the pass is built (`LatentMoEFusionPass()`, `lmf.install()`)",
    ),
    EnvVar(
        "LMF_BACKEND", text, None,
        values="A backend name: `reference`, `triton`, `deepgemm`, `cute`, `side_stream` or `shared_first`.",
        unset="Each op takes the first backend, in priority order, that can run the arguments.",
        effect="Forces that backend on every op that has one of that name; ops without one of that name select as "
               "usual. A name no op has a backend of raises ValueError (a typo, or an optional backend whose package "
               "does not import); a forced backend that cannot run the call raises RuntimeError. `reference` gives pure "
               "PyTorch on one stream; `deepgemm` also opts `lmf::routed_experts` into DeepGEMM.",
        read_in=("ops/common/backends.py",),
    ),
    EnvVar(
        "LMF_BACKEND_<OP>", text, None,
        values="The op's backends, in priority order. routed_experts: `triton`, `deepgemm` (opt-in only), `reference`. "
               "moe_shared_producer: `deepgemm`, `triton`, `reference`. latent_tail: `cute`, `triton`, `reference`. "
               "noaux_tc_route: `triton`, `reference`. route_and_project: `side_stream`, `reference`. "
               "route_and_produce: `shared_first`, `reference`. route_gather_and_produce: `shared_first`, `reference`.",
        unset="`LMF_BACKEND`, else priority order.",
        effect="Works like `LMF_BACKEND` for the one op `lmf::<op>` and takes precedence over it; a name that is no "
               "backend of that op raises ValueError. `LMF_BACKEND_ROUTED_EXPERTS=deepgemm` opts into DeepGEMM's sm_90 "
               "grouped GEMMs. `LMF_BACKEND_LATENT_TAIL=cute` forces the CuTe tail wherever its shapes fit, bypassing "
               "the measured table.",
        read_in=("ops/common/backends.py",),
        prefix="LMF_BACKEND_",
        members=tuple(f"LMF_BACKEND_{op.upper()}" for op in BACKEND_OPS),
    ),
    EnvVar(
        "LMF_CHECK_IDS", switch("check the ids, the default", "skip the check on CUDA tensors"), True,
        values="`0`, `1`",
        unset="Check on.",
        effect="Whether the routed ops (`lmf::routed_experts`, `lmf::moe_shared_producer`, also inside "
               "`lmf::route_and_produce`) check topk_ids < E on CUDA tensors. The check reads the largest id back, "
               "which is a host sync; on the Triton backends it waits only after the op's launches. With `0`, bad ids "
               "index out of bounds, so use it only with a router known to be correct. CUDA-graph capture always "
               "skips the check, and CPU tensors are always checked.",
        read_in=("ops/routed/expert_ids_check.py",),
    ),
    EnvVar(
        "LMF_ROUTED_W4A8", switch("FP8 activations on the prefill blocks", "BF16 activations, the default"), False,
        values="`0`, `1`",
        unset="BF16 activations (the default numerics).",
        effect="Opt-in W4A8 numerics for the routed MXFP4 experts where the grouping takes the 128-row prefill blocks "
               "(sm_90): activations quantised to e4m3 in 1 x 128 blocks with FP32 scales, the e2m1 weights expanded "
               "to e4m3 per 64 x 128 block, FP8 wgmma with the sums promoted to FP32 every 128 K "
               "(`ops/routed/w4a8_numerics.py` defines it; docs/numerics.md gives its error, ~20x the BF16 path's). "
               "Calls on other kernels (decode blocks, the GEMV, Triton tiles) and calls the W4A8 kernels cannot take "
               "(L or I not a multiple of 512) keep BF16 activations; `python -m latent_moe_fusion plan` says which.",
        read_in=("ops/routed/w4a8_path.py", "ops/routed/producer_config.py"),
    ),
    EnvVar(
        "LMF_ROUTED_FP8",
        choice(ROUTED_FP8_WORDS, "1: the L1 on FP8 MMAs, the default; l1,l2: both layers; 0: neither, the bf16 "
                                 "kernels"),
        None,
        values="`0`, `1`, `l1,l2`",
        unset="Like `1`, but a call the FP8 kernels cannot take runs the bf16 kernels.",
        effect="Numerics of the routed MXFP4 experts at decode sizes where the grouping takes 16-row blocks (sm_90 "
               "register-dequant path, no routed GEMV, no K split). `1` runs the routed L1 on FP8 MMAs, `l1,l2` runs "
               "L1 and L2 there (activations split into two e4m3 parts), and `0` keeps the bf16 kernels. Not bitwise "
               "the bf16 kernels (activations ~7e-4 from them). When set, a call on that path that the FP8 kernels "
               "cannot take raises and says why (device, weights' layout, or a latent / intermediate size that is not "
               "a multiple of 512).",
        read_in=("ops/routed/producer_config.py",),
    ),
    EnvVar(
        "LMF_DOWN_PROJECTION", down_projection_kernel, "triton",
        values="`cublas`, `triton`",
        unset="`triton`: the measured table up to 64 tokens (up to 4: `swap` with split 2; up to 16 and up to 32: "
              "`swap_tma` unsplit; up to 64: `swap_tma` with split 2), cuBLAS beyond.",
        effect="Which kernel computes the latent down-projection z = x @ w_down^T inside `lmf::route_and_project` and "
               "`lmf::route_and_produce`. The Triton kernel runs only for bf16 on Hopper; cuBLAS runs elsewhere. Triton "
               "agrees with cuBLAS to bf16 rounding, not bitwise; `cublas` gives back the unfused bits. (Another swap "
               "kernel for the Triton side: the `down_projection_kernel` tuning override.)",
        read_in=("ops/routed/router_fused/down_projection.py",),
    ),
    EnvVar(
        "LMF_SYMM_EXCHANGE", folded_choice(("auto", "on", "off"), "auto"), "auto",
        values="`auto`, `on`, `off` (case and spaces ignored)",
        unset="`auto`",
        effect="Agreed across the group by the minimum: if any rank has `off`, `prepare_symmetric_exchange` returns "
               "None and every rank keeps torch.distributed. `auto` takes the symmetric-memory path within the "
               "measured token windows (copies: from 8 tokens; kernel: from 1); `on` takes it wherever the workspace "
               "fits (up to max_tokens). Moves bitwise the same bytes as torch.distributed.",
        read_in=("ops/common/symm_exchange.py",),
        read_when="once, by `prepare_symmetric_exchange`",
    ),
    EnvVar(
        "LMF_SYMM_EXCHANGE_METHOD", folded_choice(("kernel", "copies"), "copies"), "copies",
        values="`copies`, `kernel` (case and spaces ignored)",
        unset="`copies`",
        effect="`copies` uses torch copies between two workspace barriers; `kernel` uses one Triton launch with one "
               "signal per program and peer (ops/common/peer_exchange.py), so far run on one GPU only. Must be "
               "the same on every rank, else ValueError. Same bits either way.",
        read_in=("ops/common/symm_exchange.py",),
        read_when="once, by `prepare_symmetric_exchange`",
    ),
    EnvVar(
        "LMF_DEEPGEMM_FP8_ACTIVATIONS",
        switch("accept FP8 routed activations", "keep the BF16 contract, the default"), False,
        values="`0`, `1`",
        unset="Off.",
        effect="Opts in to DeepGEMM's sm_100 MegaMoE backend of `lmf::moe_shared_producer` (priority 5; it also needs "
               "`prepare_deepgemm_producer`). That backend quantizes the routed activations (z and the SiTU output) to "
               "FP8 e4m3 with per-32 UE8M0 scales, which breaks the BF16 contract's numerics. The mapping has not run "
               "on hardware.",
        read_in=("ops/routed/deepgemm/sm100_mega_moe.py",),
    ),
    EnvVar(
        "TRITON_INTERPRET", triton_flag, False,
        values="Triton's: `1`, `true`, `on` (case ignored) mean on.",
        unset="Off: compiled kernels.",
        effect="Triton runs kernels in its interpreter (CPU tensors; tests without a GPU). The package then picks "
               "interpreter-friendly configs, runs no Gluon kernels and launches nothing as a programmatic dependent.",
        read_in=("ops/routed/gluon/__init__.py", "ops/common/pdl.py", "ops/routed/producer_config.py",
                 "ops/common/tail_gemm/tail_launch.py"),
        audience=DEVELOPER,
    ),
    EnvVar(
        "CUTE_DSL_ARCH", text, None,
        values="CUTLASS DSL's: an arch such as `sm_90a`.",
        unset="`sm_90a`",
        effect="The CuTe tail's compile target (set it to compile on a machine without that GPU).",
        read_in=("ops/tail/cute/tail_runtime.py",),
        audience=DEVELOPER,
    ),
)
VARIABLES: dict[str, EnvVar] = {v.name: v for v in _DECLARED}
_FAMILIES = tuple(v for v in _DECLARED if v.prefix)

# Variables read before the tuning overrides existed: setting one now does nothing, so say what replaced it.
RETIRED: dict[str, str] = {
    "LMF_PDL": "pdl_sites",
    "LMF_TAIL_PREFETCH": "tail_prefetch",
    "LMF_TAIL_GEMV": "tail_gemv",
    "LMF_ROUTED_GEMV": "routed_gemv",
    "LMF_MXFP4_REGS": "mxfp4_regs",
    "LMF_MXFP4_RING": "mxfp4_ring",
    "LMF_MXFP4_LOAD_ORDER": "mxfp4_load_order",
    "LMF_MXFP4_MAXNREG": "mxfp4_maxnreg",
    "LMF_PREFILL_REGS": "prefill_regs",
    "LMF_REGS_SPLIT": "regs_split",
    "LMF_PRODUCER_DECODE_SHARED_TILES": "producer_decode_shared_tiles",
    "LMF_PRODUCER_SHARED_SPLIT": "producer_shared_split",
    "LMF_PRODUCER_SHARED_L2_ROWS": "producer_shared_l2_rows",
    "LMF_PRODUCER_SHARED_L2_K": "producer_shared_l2_k",
    "LMF_GROUP_FIRST": "group_first",
    "LMF_REGS_SHARED": "regs_shared",
    "LMF_GRID_SHARED": "grid_shared",
    "LMF_SHARED_IN_LINE": "shared_in_line",
    "LMF_ROUTER_OVERLAP": "router_overlap_streams",
    "LMF_ROUTER_OVERLAP_ORDER": "router_overlap_order",
    "LMF_SHARED_FIRST": "shared_first_schedule",
    "LMF_SHARED_FIRST_ORDER": "shared_first_order",
    "LMF_SHARED_FIRST_URGENT": "shared_first_urgent",
    "LMF_CUTE_TAIL_CHOICE": "cute_tail_choice",
    "LMF_DEEPGEMM_ROUTED_LAYOUT": "deepgemm_routed_layout",
}
_retired_checked = False


def entry(name: str) -> EnvVar:
    """The declaration of `name` (a family's for its members); an undeclared name raises KeyError."""
    found = VARIABLES.get(name) or next((f for f in _FAMILIES if name.startswith(f.prefix)), None)
    if found is None:
        raise KeyError(f"{name} is not declared in latent_moe_fusion/envs.py: declare it there before reading it")
    return found


def raw(name: str) -> str:
    """The variable's text as set ("" when unset), unparsed: for cache keys that must follow every change."""
    entry(name)
    return os.environ.get(name, "")


def is_set(name: str) -> bool:
    """Whether `name` is set to a non-empty value."""
    return raw(name) != ""


def read(name: str) -> Any:
    """`name`'s parsed value (its default when unset or empty); a value it does not accept raises ValueError that
    names the variable and what it takes. Read on every call: nothing is cached."""
    _warn_retired_once()
    declared = entry(name)
    value = os.environ.get(name, "")
    return declared.default if value == "" else declared.parse(name, value)


def retired_in_environment() -> list[tuple[str, str]]:
    """(variable, the tuning override that replaced it) for every retired variable set in this environment."""
    return [(name, field) for name, field in RETIRED.items() if os.environ.get(name)]


def _warn_retired_once() -> None:
    global _retired_checked
    if _retired_checked:
        return
    _retired_checked = True
    for name, field in retired_in_environment():
        warnings.warn(f"{name} is set but latent_moe_fusion no longer reads it: tuning knobs are tuning overrides now, "
                      f"`with latent_moe_fusion.tuning.overrides({field}=...):` (docs/switches.md)", stacklevel=3)


def _cell(text_: str) -> str:
    return text_.replace("|", "\\|")


def _code(name: str) -> str:
    return f"`{name}`"


def _variable_rows(audience: str) -> list[str]:
    rows = ["| variable | values | unset | what it does | read | read in |", "|---|---|---|---|---|---|"]
    for v in _DECLARED:
        if v.audience != audience:
            continue
        head = _code(v.name) + (": " + ", ".join(map(_code, v.members)) if v.members else "")
        read_in = ", ".join(_code(m) for m in v.read_in)
        rows.append(f"| {head} | {_cell(v.values)} | {_cell(v.unset)} | {_cell(v.effect)} | {v.read_when} | {read_in} |")
    return rows


def markdown() -> str:
    """docs/switches.md: the variables above and the tuning overrides (tests/test_envs.py keeps the file equal)."""
    from . import tuning

    lines = [
        "# Environment switches and tuning overrides",
        "",
        "Generated from `latent_moe_fusion/envs.py` and `latent_moe_fusion/tuning.py` by "
        "`python -m latent_moe_fusion switches --markdown > docs/switches.md`; edit those, not this file. "
        "`python -m latent_moe_fusion switches` prints the current values.",
        "",
        "An unknown value raises a ValueError that names the variable (or override) and what it accepts; only "
        "`LMF_DISABLE_FUSION` takes any value. A CUDA graph replays what was captured, so set a switch before "
        "capture. In a multi-rank job every rank must set the same values, because the selection decisions must "
        "agree across ranks: the package itself agrees only `LMF_DISABLE_FUSION` and `LMF_SYMM_EXCHANGE` / "
        "`LMF_SYMM_EXCHANGE_METHOD` across the group.",
        "",
        "## Operator variables",
        "",
        *_variable_rows(OPERATOR),
        "",
        "## Other tools' variables the package also reads",
        "",
        *_variable_rows(DEVELOPER),
        "",
        "## Tuning overrides (benchmarks and experiments; not environment variables)",
        "",
        "The measured defaults can be overridden per `with` block, in code: "
        "`with latent_moe_fusion.tuning.overrides(mxfp4_ring=\"tma,cp4\", group_first=False): ...`. The values are "
        "checked on entry; each is read when an op runs (inside torch.compile'd code and CUDA-graph capture too), "
        "by the thread that entered the block. Blocks nest: an inner one changes only the fields it names. None "
        "is the measured default. Text forms (`\"1\"`, `\"2,4\"`, `\"16x128\"`) are accepted too, for command "
        "lines (`bench/decode_tuning.py --knobs`).",
        "",
        "| override | values | None (the default) | what it does | read in |",
        "|---|---|---|---|---|",
    ]
    for name, knob in tuning.knobs().items():
        lines.append(f"| `{name}` | {_cell(knob.values)} | {_cell(knob.default)} | {_cell(knob.effect)} | "
                     f"`{knob.read_in}` |")
    lines += [
        "",
        "## Retired variables",
        "",
        "These were read before the tuning overrides; setting one now does nothing but warn once.",
        "",
        "| variable | now |",
        "|---|---|",
        *(f"| `{name}` | `tuning.overrides({field}=...)` |" for name, field in RETIRED.items()),
    ]
    return "\n".join(lines) + "\n"


def describe() -> str:
    """The operator variables as set in this environment, the tuning overrides active in this context and any
    retired variable still set (`python -m latent_moe_fusion switches`)."""
    from . import tuning

    lines = ["Operator variables (docs/switches.md):"]
    for v in _DECLARED:
        if v.audience != OPERATOR:
            continue
        names = [n for n in sorted(os.environ) if n.startswith(v.prefix)] if v.prefix else [v.name]
        for name in names or [v.name]:
            given = os.environ.get(name, "")
            try:
                with warnings.catch_warnings():  # retired variables get their own line below
                    warnings.simplefilter("ignore")
                    shown = repr(read(name) if not v.prefix or given else None)
            except ValueError as err:
                shown = f"invalid: {err}"
            lines.append(f"  {name} = {given!r} -> {shown}" if given else f"  {name} unset -> {shown}")
    active = tuning.current().active()
    lines.append("Tuning overrides active here: " + (", ".join(f"{k}={v!r}" for k, v in active.items()) or
                                                     "none (set in code: latent_moe_fusion.tuning.overrides)"))
    for name, field in retired_in_environment():
        lines.append(f"Retired: {name} is set but no longer read; use tuning.overrides({field}=...)")
    return "\n".join(lines)

