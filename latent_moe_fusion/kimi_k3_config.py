"""Kimi K3 latent-MoE configuration (docs/design.md, section 1) and its validation."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MXFP4_BLOCK = 32  # one E8M0 scale per 32 values along K


class ConfigError(ValueError):
    """A configuration value that no backend or layout can serve."""


@dataclass(frozen=True)
class KimiK3MoEConfig:
    """Sizes of one Kimi K3 MoE layer. Defaults are the real model's numbers."""

    hidden_size: int = 7168  # H
    latent_size: int = 3584  # L, `routed_expert_hidden_size`
    num_experts: int = 896  # E
    top_k: int = 16  # K
    moe_intermediate_size: int = 3072  # I, per routed expert
    shared_intermediate_size: int = 6144  # 2 shared experts merged, full (all TP ranks)
    rms_norm_eps: float = 1e-5
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    routed_scaling_factor: float = 1.0

    @classmethod
    def tiny(cls) -> KimiK3MoEConfig:
        """Small sizes for CPU tests; every divisibility constraint stays legal up to R = 4."""
        return cls(
            hidden_size=256,
            latent_size=128,
            num_experts=16,
            top_k=4,
            moe_intermediate_size=64,
            shared_intermediate_size=128,
        )

    def replace(self, **changes) -> KimiK3MoEConfig:
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "latent_size",
            "num_experts",
            "top_k",
            "moe_intermediate_size",
            "shared_intermediate_size",
        ):
            value = getattr(self, name)
            # bool is an int subclass: True would pass as a size of 1.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KimiK3MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"KimiK3MoEConfig.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})"
            )
        for name in ("rms_norm_eps", "situ_beta", "situ_linear_beta", "routed_scaling_factor"):
            value = getattr(self, name)
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (is_number and math.isfinite(value) and value > 0):
                raise ConfigError(f"KimiK3MoEConfig.{name} must be a finite number > 0, got {value!r}")

    def validate_for(
        self, world_size: int = 1, weight_format: str = "bf16", ep_size: int = 1
    ) -> None:
        """Raise ConfigError if these sizes cannot run on `world_size` TP ranks in `weight_format`."""
        if weight_format not in ("bf16", "mxfp4"):
            raise ConfigError(f"weight_format must be 'bf16' or 'mxfp4', got {weight_format!r}")
        if world_size < 1:
            raise ConfigError(f"world size must be >= 1, got {world_size}")
        if self.shared_intermediate_size % world_size:
            raise ConfigError(
                f"shared_intermediate_size {self.shared_intermediate_size} is not divisible by "
                f"the TP world size {world_size}: each rank needs an equal shard of the shared expert"
            )
        if self.hidden_size % world_size:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by the TP world size "
                f"{world_size}: the hidden_scatter layout gives each rank H/R columns"
            )
        if ep_size < 1 or self.num_experts % ep_size:
            raise ConfigError(
                f"num_experts {self.num_experts} is not divisible by the expert-parallel size {ep_size}"
            )
        if weight_format == "mxfp4":
            for name in ("latent_size", "moe_intermediate_size"):
                value = getattr(self, name)
                if value % MXFP4_BLOCK:
                    raise ConfigError(
                        f"KimiK3MoEConfig.{name} = {value} is not divisible by {MXFP4_BLOCK}: "
                        "MXFP4 stores one E8M0 scale per 32 values along K"
                    )
