"""CuTe DSL backends (optional `cute` extra: nvidia-cutlass-dsl). Importing this registers them without
importing cutlass; kernels compile on first use or in `warmup()` (before any CUDA-graph capture)."""

from .tail_backend import available, measured_choice
from .tail_runtime import CuteCompileDuringCapture, tail_cute_fused, warmup

__all__ = ["CuteCompileDuringCapture", "available", "measured_choice", "tail_cute_fused", "warmup"]
