"""Replaying a captured CUDA graph with host synchronisation forbidden (decode must never sync the host)."""

from __future__ import annotations

import torch


def replay_without_host_sync(graph: torch.cuda.CUDAGraph) -> None:
    """graph.replay() with torch's sync debug mode at "error": any host sync in it raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
