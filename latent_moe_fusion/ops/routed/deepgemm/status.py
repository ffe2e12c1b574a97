"""One sentence for reports (the fusion pass's, a benchmark's): what DeepGEMM does here and why."""

from __future__ import annotations

from .agree import _AGREED, current_answer
from .probe import SM90_GROUPED, SM100_MEGA
from .sm100_state import _STATES

_USES = {
    SM90_GROUPED: "lmf::routed_experts (opt-in: LMF_BACKEND_ROUTED_EXPERTS=deepgemm)",
    SM100_MEGA: "lmf::moe_shared_producer (needs prepare_deepgemm_producer and LMF_DEEPGEMM_FP8_ACTIVATIONS=1)",
}


def deepgemm_status() -> str:
    answer = current_answer()
    if not answer.available:
        return f"DeepGEMM not used: {answer.reason}; the lmf ops run on the Triton/reference backends"
    where = f"DeepGEMM {answer.version} on sm_{answer.arch[0]}{answer.arch[1]}" if answer.arch else "DeepGEMM"
    parts = [f"{where}: usable for " + "; ".join(_USES[g] for g in sorted(answer.apis))]
    if answer.reason:
        parts.append(f"not usable: {answer.reason}")
    agreed = sorted(name or "local" for name in _AGREED)
    if agreed:
        parts.append("agreed over " + ", ".join(agreed))
    if _STATES:
        parts.append("MegaMoE workspaces: " + ", ".join(f"{m}@{g or 'local'}" for g, m in sorted(_STATES, key=str)))
    return "; ".join(parts)
