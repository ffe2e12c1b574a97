"""latent-moe-fusion: fused producer + tail ops for Kimi K3's latent MoE layer under torch.compile."""

from . import ops
from .config import ConfigError, KimiK3MoEConfig
from .fusion_pass import FusionConfig, FusionReport, LatentMoEFusionPass, install
from .model import KimiK3MoEBlock

__all__ = [
    "ConfigError",
    "FusionConfig",
    "FusionReport",
    "KimiK3MoEBlock",
    "KimiK3MoEConfig",
    "LatentMoEFusionPass",
    "install",
    "ops",
]
