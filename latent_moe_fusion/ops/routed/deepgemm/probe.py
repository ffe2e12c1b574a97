"""Capability probe for the optional `deep_gemm` package (DeepGEMM).

The probe answers, for this process: which DeepGEMM API groups can run here. A group is usable
when the GPU architecture matches and every function it needs is present with the parameter
names this package passes (all calls are by keyword, so a renamed parameter is a breaking
change the probe must catch). `deep_gemm` is imported only when a CUDA device of a supported
architecture exists, never when `latent_moe_fusion` is imported.

API groups:
  sm90_grouped           DeepGEMM's BF16 M-grouped GEMMs (lmf::routed_experts backend), sm_90
  sm100_mega_bf16_shared MegaMoE FP8xFP4 with a BF16 shared expert and fused routed RMSNorm
                         (lmf::moe_shared_producer backend), sm_100
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ...common.device_capability import current_capability

SM90_GROUPED = "sm90_grouped"
SM100_MEGA = "sm100_mega_bf16_shared"
API_GROUPS = (SM90_GROUPED, SM100_MEGA)

# Architecture major each group was written for.
GROUP_ARCH_MAJOR = {SM90_GROUPED: 9, SM100_MEGA: 10}

_SITU_CALL = ("activation", "situ_beta", "situ_linear_beta")
_MEGA_COMMON = (
    "y", "l1_weights", "l2_weights", "shared_x", "shared_l1_weights", "shared_l2_weights",
    "rms_weight", "rms_epsilon", "sym_buffer",
) + _SITU_CALL
_MEGA_PUBLISH = ("shared_rs_workspace", "shared_rs_flags", "shared_rs_peer_ptrs")

# function -> parameter names we pass by keyword (see the docstring of each backend module for
# the repository and path these were read from).
REQUIRED_API: dict[str, dict[str, tuple[str, ...]]] = {
    SM90_GROUPED: {
        "m_grouped_bf16_gemm_nt_masked": ("a", "b", "d", "masked_m", "expected_m"),
        "m_grouped_bf16_gemm_nt_contiguous": ("a", "b", "d", "grouped_layout"),
        "get_mk_alignment_for_contiguous_layout": (),
    },
    SM100_MEGA: {
        "get_symm_buffer_for_mega_moe": (
            "group", "num_experts", "num_max_tokens_per_rank", "num_topk", "hidden", "intermediate_hidden",
            "mma_type", "activation", "bf16_shared_intermediate_hidden",
        ),
        "transform_weights_for_mega_moe": ("l1_weights", "l2_weights", "activation"),
        "transform_sf_into_required_layout": ("sf", "mn", "k", "recipe", "num_groups"),
        "fp8_fp4_mega_moe_bf16_shared": ("shared_y",) + _MEGA_COMMON,
        "fp8_fp4_mega_moe_bf16_shared_rs": _MEGA_COMMON + _MEGA_PUBLISH,
        "fp8_fp4_mega_moe_bf16_shared_sp_rs": _MEGA_COMMON + _MEGA_PUBLISH,
    },
}


@dataclass(frozen=True)
class DeepGemmProbe:
    """What DeepGEMM can do in this process (or, once agreed, on every rank of a group)."""

    available: bool  # at least one API group is usable
    reason: str  # why a group is missing (empty when every group is usable)
    arch: tuple[int, int] | None = None
    apis: frozenset[str] = field(default_factory=frozenset)
    version: str | None = None

    def has(self, group: str) -> bool:
        return group in self.apis

    def why_not(self, group: str) -> str | None:
        """None if `group` is usable, else a sentence saying why not."""
        if group in self.apis:
            return None
        return f"DeepGEMM {group} unavailable: {self.reason or 'not probed'}"


def _device_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA device, None without one (tests monkeypatch this)."""
    return current_capability()


def _installed() -> bool:
    try:
        return importlib.util.find_spec("deep_gemm") is not None
    except (ImportError, ValueError):  # a broken or half-initialised entry in sys.modules
        return False


def _import() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module("deep_gemm"), ""
    except ModuleNotFoundError as exc:
        if exc.name == "deep_gemm":
            return None, "deep_gemm is not installed (see docs/design/deepgemm.md)"
        return None, f"import deep_gemm failed: {exc}"
    except Exception as exc:  # noqa: BLE001 -- any import failure means "unusable", with its text
        return None, f"import deep_gemm failed: {type(exc).__name__}: {exc}"


_PYBIND_SIGNATURE = re.compile(r"^\s*[\w.]+\((.*)\)\s*(->.*)?$")


def parameter_names(fn: Any) -> tuple[str, ...] | None:
    """Parameter names of a Python or pybind11 function; None when they cannot be read."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        names = []
        for p in sig.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                names.append("**")
            elif p.kind is not p.VAR_POSITIONAL:
                names.append(p.name)
        return tuple(names)
    # pybind11 builtins: the first docstring line is "name(a: T, b: T = ...) -> R".
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    match = _PYBIND_SIGNATURE.match(doc[0]) if doc else None
    if match is None:
        return None
    depth, start, parts, text = 0, 0, [], match.group(1)
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    names = tuple(p.split(":")[0].split("=")[0].strip().lstrip("*") for p in parts if p.strip())
    if any(re.fullmatch(r"arg\d+", n) for n in names):
        return None  # bound without py::arg names: keywords would not work
    return names


def check_group(module: ModuleType, group: str) -> str | None:
    """None if every function of `group` exists with the parameter names we pass, else why not."""
    for fn_name, needed in REQUIRED_API[group].items():
        fn = getattr(module, fn_name, None)
        if fn is None or not callable(fn):
            return f"deep_gemm.{fn_name} is missing"
        if not needed:
            continue
        names = parameter_names(fn)
        if names is None:
            return f"the signature of deep_gemm.{fn_name} cannot be read, so its parameter names are unchecked"
        if "**" in names:
            continue
        missing = [n for n in needed if n not in names]
        if missing:
            return f"deep_gemm.{fn_name} has no parameter(s) {', '.join(missing)} (has {', '.join(names)})"
    return None


_CACHE: dict[str, Any] = {}


def probe_deepgemm(refresh: bool = False) -> DeepGemmProbe:
    """This process's answer (cached). Imports deep_gemm only on a GPU of a supported arch."""
    if not refresh and "probe" in _CACHE:
        return _CACHE["probe"]
    _CACHE.pop("module", None)
    result = _probe()
    _CACHE["probe"] = result
    return result


def _probe() -> DeepGemmProbe:
    arch = _device_capability()
    if arch is None:
        installed = "installed" if _installed() else "not installed"
        return DeepGemmProbe(False, f"no CUDA device (deep_gemm {installed})")
    wanted = [g for g in API_GROUPS if GROUP_ARCH_MAJOR[g] == arch[0]]
    if not wanted:
        return DeepGemmProbe(
            False, f"sm_{arch[0]}{arch[1]}: DeepGEMM grouped GEMMs need sm_90, MegaMoE needs sm_100", arch
        )
    module, error = _import()
    if module is None:
        return DeepGemmProbe(False, error, arch)
    _CACHE["module"] = module
    usable, reasons = [], []
    for group in API_GROUPS:
        if group not in wanted:
            reasons.append(f"{group} needs sm_{GROUP_ARCH_MAJOR[group]}x, found sm_{arch[0]}{arch[1]}")
            continue
        why = check_group(module, group)
        if why is None:
            usable.append(group)
        else:
            reasons.append(f"{group}: {why}")
    version = str(getattr(module, "__version__", "unknown"))
    return DeepGemmProbe(bool(usable), "; ".join(reasons), arch, frozenset(usable), version)


def deep_gemm_module() -> ModuleType:
    """The imported deep_gemm module; only valid after a probe that found a usable group."""
    probe = probe_deepgemm()
    module = _CACHE.get("module")
    if module is None:
        raise RuntimeError(f"deep_gemm is not usable here: {probe.reason}")
    return module


def reset_probe() -> None:
    """Forget the cached answer (tests, or after installing DeepGEMM in a live process)."""
    _CACHE.clear()
