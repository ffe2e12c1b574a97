"""Optional DeepGEMM backends (docs/design/deepgemm.md). Importing this package never imports deep_gemm.

- lmf::moe_shared_producer on SM100 MegaMoE with a BF16 shared expert (sm100_mega_moe.py);
  needs `prepare_deepgemm_producer(...)` on every rank before forward. Not run on hardware here.
- lmf::routed_experts on SM90 BF16 grouped GEMMs (sm90_grouped.py), opt-in.
- `agree_deepgemm(group)`: the capability answer shared by every rank; `deepgemm_status()`: the
  sentence a report quotes.
"""

from . import register  # noqa: F401  (registers the backends)
from .agree import agree_deepgemm, agree_probe, reset_agreement
from .probe import DeepGemmProbe, probe_deepgemm, reset_probe
from .sm90_grouped import _BF16_COPIES
from .sm100_mega_moe import clear_weight_caches, convert_weights
from .sm100_state import prepare_deepgemm_producer, reset_states
from .status import deepgemm_status


def reset_deepgemm_state() -> None:
    """Forget probes, agreements, workspaces and converted weights (tests; after reinstalling)."""
    reset_probe()
    reset_agreement()
    reset_states()
    clear_weight_caches()
    _BF16_COPIES.clear()


__all__ = [
    "DeepGemmProbe",
    "agree_deepgemm",
    "agree_probe",
    "convert_weights",
    "deepgemm_status",
    "prepare_deepgemm_producer",
    "probe_deepgemm",
    "reset_deepgemm_state",
]
