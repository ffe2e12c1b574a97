import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_gloo


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [2])
def test_run_gloo_all_reduce(world_size):
    assert run_gloo(_sum_ranks, world_size) == [3.0, 3.0]


def _raise(rank: int, world_size: int) -> None:
    raise ValueError("boom on purpose")


def test_run_gloo_reports_worker_errors():
    with pytest.raises(RuntimeError, match="boom on purpose"):
        run_gloo(_raise, 2, timeout=60)
