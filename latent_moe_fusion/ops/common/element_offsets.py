"""Whether a kernel's element offsets into its tensors still fit int32.

Triton types integer arguments, program ids and aranges as int32, so `row * row_stride` wraps once a tensor reaches
past INT32_MAX elements (on one Kimi K3 rank the routed FP32 pair rows [M * top_k, L] pass it from M = 37450, the
routed activation rows [blocks * BM, I] from M = 42800). The launchers of the kernels that can meet such tensors ask
`needs_int64_offsets` and set the kernels' LARGE_OFFSETS constexpr, which casts the row indices to int64 before they
are multiplied by a stride. Decode sizes keep the int32 specialisation, whose code is the one compiled before the
flag existed (its branch is a constexpr, removed at compile time).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INT32_MAX = 2**31 - 1


def last_offset(shape: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a strided tensor's first element to its last (0 when empty): the largest offset a kernel that
    stays inside it computes."""
    reach = 0
    for size, stride in zip(shape, strides, strict=True):  # a plain loop: launchers call this on every launch
        if size == 0:
            return 0
        reach += (size - 1) * stride
    return reach


def needs_int64_offsets(*tensors: torch.Tensor) -> bool:
    """Whether some tensor reaches past INT32_MAX elements from its first (the kernels then need LARGE_OFFSETS).
    Shapes and strides only: meta and fake tensors serve."""
    for t in tensors:
        if last_offset(t.shape, t.stride()) > INT32_MAX:
            return True
    return False


def beyond_int32_reason(kernel: str, layouts: dict[str, tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """For a kernel that indexes in int32 only: which of its tensors ({name: (shape, strides)}) reaches past
    INT32_MAX elements, and the limit; None if none does."""
    for name, (shape, strides) in layouts.items():
        reach = last_offset(shape, strides)
        if reach > INT32_MAX:
            return (f"{name} {tuple(shape)} reaches {reach} elements past its first, beyond the int32 offsets of the "
                    f"{kernel} (at most {INT32_MAX})")
    return None
