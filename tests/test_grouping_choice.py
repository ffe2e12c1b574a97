"""The expert grouping that picks its block size on the GPU (moe_align_choice; TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.triton.moe_align import max_blocks
from latent_moe_fusion.ops.routed.triton.moe_align_choice import group_by_expert_choice, small_blocks_bound
from tests.grouping_checks import assert_unused_grouping, assert_valid_grouping

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, SMALL, LARGE, MAX_ROWS = 8, 16, 64, 32


def _ids_with_counts(counts: list[int], top_k: int, foreign: int = 0) -> torch.Tensor:
    """ids [M, top_k] in which expert e appears counts[e] times (at most once per token), the rest -1 or, for
    `foreign` of them, ids of experts beyond the local ones (other ranks)."""
    m = max(max(counts), 1)
    ids = torch.full((m, top_k), -1, dtype=torch.int32)
    for expert, count in enumerate(counts):
        tokens = torch.randperm(m)[:count]
        ids[tokens, expert % top_k] = expert  # slot e % top_k: distinct experts per token when len(counts) <= top_k
    free = torch.nonzero(ids.view(-1) < 0).view(-1)
    ids.view(-1)[free[torch.randperm(free.numel())[:foreign]]] = EXPERTS + 5
    return ids.to(DEVICE)


def _check(ids: torch.Tensor, expect_small: bool) -> None:
    choice = group_by_expert_choice(ids, EXPERTS, SMALL, LARGE, MAX_ROWS)
    assert choice.small.nb_max == small_blocks_bound(ids.numel(), EXPERTS, SMALL, MAX_ROWS)
    assert choice.large.nb_max == max_blocks(ids.numel(), EXPERTS, LARGE)
    assert int(choice.picked_small.item()) == int(expect_small)
    picked, unpicked = (choice.small, choice.large) if expect_small else (choice.large, choice.small)
    assert_valid_grouping(picked, ids, EXPERTS)
    assert_unused_grouping(unpicked)


def test_few_rows_per_local_expert_pick_the_small_blocks(rng_seed):
    # An EP share: most ids on other ranks (-1), the local experts hold ~20 rows each.
    ids = torch.randint(0, 4 * EXPERTS, (160, 4), dtype=torch.int32)
    ids = torch.where(ids < EXPERTS, ids, -1).to(DEVICE)
    assert int((ids >= 0).sum()) <= MAX_ROWS * EXPERTS
    _check(ids, expect_small=True)


def test_many_rows_per_local_expert_pick_the_large_blocks(rng_seed):
    ids = torch.stack([torch.randperm(EXPERTS)[:4] for _ in range(160)]).to(torch.int32).to(DEVICE)  # 80 rows each
    _check(ids, expect_small=False)


@pytest.mark.parametrize("extra", [0, 1])
def test_the_bound_is_on_mean_rows_per_hit_expert(extra, rng_seed):
    # Three experts hit, MAX_ROWS * 3 local pairs: small blocks; one more pair: large. Ids of other ranks' experts
    # (beyond the local ones) count for neither.
    counts = [MAX_ROWS + 7, MAX_ROWS - 7 + extra, 0, MAX_ROWS, 0, 0, 0, 0]
    _check(_ids_with_counts(counts, top_k=8, foreign=40), expect_small=extra == 0)


@pytest.mark.parametrize("counts", [[MAX_ROWS * 3 - 5, 1, 1, 1, 0, 0, 0, 0], [17] * 8, [1] * 8, [MAX_ROWS] * 8])
def test_picked_small_blocks_fit_their_bound(counts, rng_seed):
    """Skewed or even, the small grouping's used blocks stay within small_blocks_bound (its grids' size)."""
    _check(_ids_with_counts(counts, top_k=8), expect_small=True)


def test_no_local_pair_groups_nothing(rng_seed):
    ids = torch.full((70, 4), -1, dtype=torch.int32, device=DEVICE)
    choice = group_by_expert_choice(ids, EXPERTS, SMALL, LARGE, MAX_ROWS)
    assert_unused_grouping(choice.small)
    assert_unused_grouping(choice.large)


def test_bad_block_sizes_say_what_is_wrong():
    ids = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="0 < small_m < large_m"):
        group_by_expert_choice(ids, EXPERTS, LARGE, SMALL, MAX_ROWS)
    with pytest.raises(ValueError, match="max_rows >= 1"):
        group_by_expert_choice(ids, EXPERTS, SMALL, LARGE, 0)
