"""The kappa kernels' column order (ops/routed/gluon/routed_kappa.py) on CPU: to_kappa_columns is the permutation
lut_dequant.to_kappa applies to the register kernels' activation tiles and kappa_positions its map, and the Triton
gather (triton/kappa_columns.py, under the interpreter here) gives each block row its token's row in that order and
refuses what it cannot take, saying which condition failed."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.triton.kappa_columns import gather_kappa_rows, kappa_positions, to_kappa_columns


def _kappa_of(k: torch.Tensor) -> torch.Tensor:
    """lut_dequant's definition: k = 32q + 8w + 4e + 2h + c0 sits at kappa = 32w + 16c0 + 8h + 2q + e."""
    q, w, e, h, c0 = k // 32, (k // 8) % 4, (k // 4) % 2, (k // 2) % 2, k % 2
    return 32 * w + 16 * c0 + 8 * h + 2 * q + e


def test_kappa_positions_follow_the_dequantiser_definition():
    k = torch.arange(384)
    assert torch.equal(kappa_positions(384), k - k % 128 + _kappa_of(k % 128))
    assert sorted(kappa_positions(384).tolist()) == list(range(384))  # a permutation within each chunk


def test_to_kappa_columns_puts_column_k_at_its_position():
    x = torch.randn(5, 256)
    y = to_kappa_columns(x)
    assert y.is_contiguous()
    assert torch.equal(y[:, kappa_positions(256)], x)


# unused blocks after the used ones (as the grouping lays them out) and between them; more row groups than the
# interpreter's programs, so that each program strides over several
@pytest.mark.parametrize("block_expert", [[3], [0, 2, -1], [1, -1, -1, -1], [2, -1, 0, 1, -1, 3, 0]])
def test_gather_kappa_rows_takes_each_rows_token(block_expert, rng_seed):
    top_k, tokens, block_rows = 2, 6, 32
    blocks = torch.tensor(block_expert, dtype=torch.int32)
    rows = blocks.numel() * block_rows
    z = torch.randn(tokens, 256, dtype=torch.bfloat16)
    sorted_pairs = torch.randint(-1, tokens * top_k, (rows + 3,), dtype=torch.int32)  # -1: padding; 3 rows beyond
    out = gather_kappa_rows(z, sorted_pairs, blocks, block_rows, top_k)
    src = (sorted_pairs[:rows].clamp(min=0) // top_k).long()  # padding rows read token 0
    used = (blocks >= 0).repeat_interleave(block_rows)
    assert out.shape == (rows, 256)
    assert torch.equal(out[used], to_kappa_columns(z[src])[used])  # the unused blocks' rows are not asked about


def test_gather_kappa_rows_rejects_what_it_cannot_take():
    one = torch.zeros(1, dtype=torch.int32)
    pairs32 = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"n a multiple of 128, got shape \(4, 200\)"):
        gather_kappa_rows(torch.randn(4, 200), pairs32, one, 32, 1)
    with pytest.raises(ValueError, match=r"n a multiple of 128, got shape \(512,\)"):
        gather_kappa_rows(torch.randn(512), pairs32, one, 32, 1)
    with pytest.raises(ValueError, match=r"x must be contiguous \(pass x.contiguous\(\)\)"):
        gather_kappa_rows(torch.randn(256, 4).t(), pairs32, one, 32, 1)
    with pytest.raises(ValueError, match="need 32 sorted pairs, got 8"):
        gather_kappa_rows(torch.randn(4, 128), torch.zeros(8, dtype=torch.int32), one, 32, 1)
    with pytest.raises(ValueError, match="block_rows must be a multiple of 32, got 48"):
        gather_kappa_rows(torch.randn(4, 128), torch.zeros(48, dtype=torch.int32), one, 48, 1)
