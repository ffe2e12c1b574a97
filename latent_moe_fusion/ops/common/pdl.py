"""Programmatic dependent launch (PDL, sm_90+): which of the library's launches overlap their predecessor.

In a decode forward every kernel streams weights that do not depend on the kernel before it, yet a
plain launch starts only after that kernel has finished and the launch latency has passed. With PDL a
kernel is launched with CUDA's programmatic stream serialisation: its programs may start as soon as
every program of the kernel before it has signalled (`griddepcontrol.launch_dependents`, which our
producers issue first thing) and must execute `griddepcontrol.wait` before they touch anything that
kernel, or any earlier one, writes. Before the wait a kernel only reads weights (into L2) and data
written before its predecessor started, and writes nothing.

Sites (the pdl_sites tuning override, a comma list; "all" or "none"/"0"; read per call so a benchmark can A/B them):
  tail    the latent tail's decode kernels: Triton's prefetch their weight rows to L2, then wait; the
          CuTe kernel loads the weight tiles of its first ring stages, then waits (cute/tail_kernel.py);
          the combine before them signals early
  routed  the routed register-dequant chain L1 -> L1 finish -> L2 of a single token (K split): L1
          signals early, the finish and L2 are launched dependent (L2 prefetches its weight rows first).
          Since the routed GEMV took one to four tokens (triton_kernels/routed_gemv.py, no PDL) this
          chain runs for a token only with the routed_gemv override False.
"""

from __future__ import annotations

from typing import Any

import torch

from latent_moe_fusion import envs, tuning

from .device_capability import capability

PDL_OVERRIDE = "pdl_sites"
PDL_SITES = ("tail", "routed")
# H200 (docs/design/decode-schedule.md): in CUDA graphs a plain dependent launch already starts ~0.4 us
# after its predecessor, so PDL buys the weight prefetch: at M = 1 the block took 99.4 us without PDL,
# 97.7 with the tail's and 95.9 with both sites. The
# routed site acts only on a single token's K-split chain (expert_schedule): at M = 8 its waiting L2
# programs held SM slots that L1 needs (+9 us).
DEFAULT_SITES = frozenset(PDL_SITES)


def _sites(name: str, value: Any) -> tuple[str, ...]:
    """The override as the sites it turns on, in PDL_SITES order; an unknown site raises."""
    if isinstance(value, bool):
        return PDL_SITES if value else ()
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "none", "off"):
            return ()
        if text in ("1", "all", "on"):
            return PDL_SITES
        given = [s.strip() for s in text.split(",") if s.strip()]
    else:
        given = list(value) if isinstance(value, (tuple, list, set, frozenset)) else [value]
    unknown = sorted({s if isinstance(s, str) else repr(s) for s in given} - set(PDL_SITES))
    if unknown:
        raise ValueError(f"{name}={value!r}: unknown site(s) {', '.join(unknown)}; expected a comma list of "
                         f"{', '.join(PDL_SITES)}, or all / none")
    return tuple(s for s in PDL_SITES if s in given)


tuning.register(PDL_OVERRIDE, _sites)


def enabled_sites() -> frozenset[str]:
    """The sites the pdl_sites override turns on (DEFAULT_SITES when None)."""
    sites = tuning.current().pdl_sites
    return DEFAULT_SITES if sites is None else frozenset(sites)


def device_supports_pdl(device: torch.device) -> bool:
    """Hopper or newer, compiled (the interpreter runs no PTX)."""
    if device.type != "cuda" or envs.read("TRITON_INTERPRET"):  # before touching CUDA: the interpreter may run on CPU
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return capability_supports_pdl(capability(index))


def capability_supports_pdl(device_capability: tuple[int, int] | None) -> bool:
    """device_supports_pdl for a CUDA device of this capability (None: no CUDA device)."""
    return device_capability is not None and not envs.read("TRITON_INTERPRET") and device_capability >= (9, 0)


def site_enabled(site: str) -> bool:
    """Whether the pdl_sites override turns `site` on."""
    if site not in PDL_SITES:
        raise ValueError(f"unknown PDL site {site!r}; expected one of {', '.join(PDL_SITES)}")
    return site in enabled_sites()


def use_pdl(site: str, device: torch.device) -> bool:
    """Whether launches of `site` on `device` go out as programmatic dependents (and their producers signal)."""
    return site_enabled(site) and device_supports_pdl(device)


def use_pdl_on(site: str, device_capability: tuple[int, int] | None) -> bool:
    """use_pdl for a device of this capability (the plans: ops/tail/tail_plan.py)."""
    return site_enabled(site) and capability_supports_pdl(device_capability)
