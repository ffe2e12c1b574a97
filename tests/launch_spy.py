"""A stand-in for a @triton.jit kernel that records one keyword of every launch, then launches the kernel: tests see
what a launcher passed (a constexpr flag, say) without reading compiled code."""

from __future__ import annotations

from typing import Any


class LaunchSpy:
    def __init__(self, kernel: Any, keyword: str, seen: list) -> None:
        self.kernel, self.keyword, self.seen = kernel, keyword, seen

    def __getitem__(self, grid: Any):
        def launch(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(kwargs[self.keyword])
            return self.kernel[grid](*args, **kwargs)

        return launch
