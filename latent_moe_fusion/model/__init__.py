"""The reference (unfused) Kimi K3 latent-MoE block."""

from .block import KimiK3MoEBlock

__all__ = ["KimiK3MoEBlock"]
