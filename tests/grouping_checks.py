"""What every expert grouping (moe_align.Grouping) must satisfy, checked on the host."""

from __future__ import annotations

import torch

from latent_moe_fusion.ops.routed.triton.moe_align import Grouping


def assert_valid_grouping(g: Grouping, ids: torch.Tensor, num_experts: int) -> None:
    """Every valid pair of ids in exactly one row, blocks in expert order with used ones first, every row's pair
    routed to its block's expert, no empty used block and no pair in an unused one."""
    rows = g.sorted_pairs.cpu().view(g.nb_max, g.block_m)
    owners = g.block_expert.cpu()
    flat = ids.cpu().reshape(-1)
    placed = rows[rows >= 0]
    valid = torch.nonzero((flat >= 0) & (flat < num_experts)).view(-1).int()
    assert torch.equal(placed.sort().values, valid)  # every valid pair exactly once, no -1 ids
    used = int((owners >= 0).sum())
    assert torch.all(owners[:used] >= 0) and torch.all(owners[used:] == -1)
    assert torch.all(owners[:used][1:] >= owners[:used][:-1])  # blocks in expert order
    for b in range(g.nb_max):
        members = rows[b][rows[b] >= 0].long()
        assert torch.all(flat[members] == owners[b])
        assert (members.numel() > 0) == (b < used)


def assert_unused_grouping(g: Grouping) -> None:
    """The grouping the GPU did not pick: no used block, no row."""
    assert torch.all(g.block_expert.cpu() == -1) and torch.all(g.sorted_pairs.cpu() == -1)
