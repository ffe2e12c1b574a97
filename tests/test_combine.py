"""The top-k combine (Triton; interpreted on the CPU): slot-ordered FP32 sum of the expert rows, one
rounding, RMSNorm; with K-split pair rows, the slices added in order first. With the norm and from 3
slices on it runs in column chunks (registers), which must give the same y bitwise and y_n within its
last place."""

import pytest
import torch

from latent_moe_fusion.ops.routed.triton.combine import combine_tiles, launch_combine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _inputs(m: int, top_k: int, latent: int, split: int):
    pairs = torch.randn(split, m * top_k, latent, device=DEVICE)
    ids = torch.randint(0, 4, (m, top_k), device=DEVICE, dtype=torch.int32)
    ids[torch.rand(m, top_k, device=DEVICE) < 0.3] = -1  # slots of other ranks' experts
    weights = torch.rand(m, top_k, device=DEVICE)
    rms = torch.rand(latent, device=DEVICE).to(torch.bfloat16) + 0.5
    return pairs, ids, weights, rms


def _ordered_slice_sum(pairs: torch.Tensor) -> torch.Tensor:
    total = pairs[0].clone()
    for s in range(1, pairs.shape[0]):
        total += pairs[s]
    return total


def _reference64(pairs, ids, weights, rms):
    rows = pairs.double().sum(0).view(*ids.shape, -1)
    y = (torch.where(ids >= 0, weights.double(), 0.0)[..., None] * rows).sum(1)
    y_n = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * rms.double()
    return y, y_n


def test_chunks_bound_the_loads_in_flight():
    assert combine_tiles(3584, 16, 4) == (4096, 256, 8)  # 16 x 4 rows of one float per thread
    assert combine_tiles(200, 16, 7)[:2] == (256, 128)  # two chunks: the case below
    assert combine_tiles(48, 4, 3)[:2] == (64, 64)


@pytest.mark.parametrize("split", [3, 4, 7])
@pytest.mark.parametrize("latent,top_k", [(48, 4), (200, 16)])
def test_chunked_slices_match_the_summed_rows(split, latent, top_k, rng_seed):
    m = 3
    pairs, ids, weights, rms = _inputs(m, top_k, latent, split)
    summed = _ordered_slice_sum(pairs)
    for norm in (False, True):
        out = torch.full((m, latent), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        ref = torch.full_like(out, float("nan"))
        launch_combine(pairs, ids, weights, out, rms if norm else None, EPS)
        launch_combine(summed, ids, weights, ref, rms if norm else None, EPS)
        y64, y_n64 = _reference64(pairs, ids, weights, rms)
        expected = y_n64 if norm else y64
        rel = float((out.double() - expected).norm() / expected.norm())
        assert rel < 8e-3, (norm, rel)
        if norm:  # the sum of squares is reduced per chunk: the last place may move
            assert (out.float() - ref.float()).abs().max() <= ref.float().abs().max() * 2 ** -7
        else:
            assert torch.equal(out, ref)


@pytest.mark.parametrize("split", [1, 2])
def test_one_pass_slices_match_float64(split, rng_seed):
    pairs, ids, weights, rms = _inputs(2, 4, 96, split)
    out = torch.full((2, 96), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    launch_combine(pairs if split > 1 else pairs[0], ids, weights, out, rms, EPS)
    _, y_n64 = _reference64(pairs, ids, weights, rms)
    assert float((out.double() - y_n64).norm() / y_n64.norm()) < 8e-3

