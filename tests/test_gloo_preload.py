"""run_gloo(preload=...): workers fork from a forkserver but still see the parent's current environment."""

import os

import torch
import torch.distributed as dist

from tests.gloo import run_gloo
from tests.multirank import PRELOAD


def _env_and_sum(rank: int, world_size: int) -> tuple[str | None, float]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return os.environ.get("LMF_TEST_MARKER"), t.item()


def test_preloaded_workers_see_the_parent_environment(monkeypatch):
    marker = os.urandom(4).hex()
    monkeypatch.setenv("LMF_TEST_MARKER", marker)
    assert run_gloo(_env_and_sum, 2, preload=PRELOAD) == [(marker, 3.0), (marker, 3.0)]
