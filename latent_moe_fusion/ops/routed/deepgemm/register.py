"""Registers the DeepGEMM backends. Importing this never imports deep_gemm: availability is
probed on first use, on a CUDA device only (the backends run on "cuda" alone)."""

from __future__ import annotations

from ...common.backends import Backend, register_backend
from . import sm90_grouped, sm100_mega_moe

# Priority 5: ahead of Triton (10) for the producer when everything it needs holds; its supports()
# still asks for the FP8-activation opt-in and a prepared workspace. Priority 50: the routed
# backend sits between Triton (10) and the reference (100) and is opt-in until measured faster.
PRODUCER = register_backend(
    Backend(
        op="moe_shared_producer",
        name="deepgemm",
        priority=5,
        device_types=("cuda",),
        fn=sm100_mega_moe.producer_deepgemm,
        available=sm100_mega_moe.available,
        supports=sm100_mega_moe.supports,
    )
)
ROUTED = register_backend(
    Backend(
        op="routed_experts",
        name=sm90_grouped.NAME,
        priority=50,
        device_types=("cuda",),
        fn=sm90_grouped.routed_deepgemm,
        available=sm90_grouped.available,
        supports=sm90_grouped.supports,
    )
)
