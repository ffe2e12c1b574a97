"""latent-moe-fusion: fused producer + tail ops for Kimi K3's latent MoE layer under torch.compile."""

from . import ops
from .config import ConfigError, KimiK3MoEConfig
from .model import KimiK3MoEBlock

__all__ = ["ConfigError", "KimiK3MoEBlock", "KimiK3MoEConfig", "ops"]
