"""latent-moe-fusion: fused producer + tail ops for Kimi K3's latent MoE layer under torch.compile."""

from typing import Any

from . import ops
from .kimi_k3_config import ConfigError, KimiK3MoEConfig
from .model import KimiK3MoEBlock
from .ops.common.symm_exchange import prepare_symmetric_exchange, release_symmetric_exchange

# The fusion pass imports torch._inductor and torch._dynamo (seconds): loaded on first use only, so
# that code using just the ops (kernels, benchmarks, spawned test workers) does not pay for it.
_FUSION_PASS_NAMES = ("FusionConfig", "FusionRecord", "FusionReport", "LatentMoEFusionPass", "install", "record_fusion")


def __getattr__(name: str) -> Any:
    if name in _FUSION_PASS_NAMES:
        from . import fusion_pass

        return getattr(fusion_pass, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "FusionConfig",
    "FusionRecord",
    "FusionReport",
    "KimiK3MoEBlock",
    "KimiK3MoEConfig",
    "LatentMoEFusionPass",
    "install",
    "ops",
    "prepare_symmetric_exchange",
    "record_fusion",
    "release_symmetric_exchange",
]
