"""Side streams for work an op runs beside its main-stream work (fork / join with the caller's stream, so
CUDA-graph capture follows them). One stream per (device, purpose): two ops that each fork never wait
on each other's side work through a shared stream.

An urgent stream has a priority above the default: when kernels of several streams wait for SM slots,
the block scheduler hands free slots to the urgent stream's blocks first. CUDA graphs keep it: a captured
kernel node carries its stream's priority and PyTorch instantiates graphs with per-node priorities."""

from __future__ import annotations

import torch

_STREAMS: dict[tuple[int, str, bool], torch.cuda.Stream] = {}


def side_stream(device: torch.device, purpose: str, urgent: bool = False) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, purpose, urgent)
    if key not in _STREAMS:
        # a lower number is a higher priority; the default, 0, is the lowest
        _STREAMS[key] = torch.cuda.Stream(device=index, priority=-1 if urgent else 0)
    return _STREAMS[key]
