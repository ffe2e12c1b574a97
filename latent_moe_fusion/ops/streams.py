"""Side streams for work an op runs beside its main-stream work (fork / join with the caller's stream, so
CUDA-graph capture follows them). One stream per (device, purpose): two ops that each fork never wait
on each other's side work through a shared stream."""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, purpose)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index)
    return _STREAMS[key]
