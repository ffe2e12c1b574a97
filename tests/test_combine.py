"""The top-k combine (Triton; interpreted on the CPU): slot-ordered FP32 sum of the expert rows, one
rounding, RMSNorm; with K-split pair rows, the slices added in order first. With the norm and from 3
slices on it runs in column chunks (registers), which must give the same y bitwise and y_n within its
last place."""

import pytest
import torch

from latent_moe_fusion.ops.triton_kernels.combine import combine_tiles, launch_combine

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


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("split", [1, 2])
def test_column_programs_match_one_program_per_row(m, split, monkeypatch, rng_seed):
    """Few rows run as column programs (combine_cols_kernel): the same y bitwise, y_n within its last place
    (the sum of squares is a fixed-order sum of per-chunk sums), bitwise the same on a second launch (the
    arrival counters reset themselves), every element written."""
    from latent_moe_fusion.ops.triton_kernels import combine

    latent, top_k = 200, 8  # chunks of 64: 4 programs per row, the last one partial
    pairs, ids, weights, rms = _inputs(m, top_k, latent, split)
    ids[-1] = -1 if m > 1 else ids[-1]  # a row with no local expert: y = 0, y_n = 0
    pairs = pairs if split > 1 else pairs[0]
    for norm in (False, True):
        outs = []
        for chunk in ("64", "64", "0"):
            monkeypatch.setenv(combine.COLS_ENV, chunk)
            out = torch.full((m, latent), float("nan"), dtype=torch.bfloat16, device=DEVICE)
            launch_combine(pairs, ids, weights, out, rms if norm else None, EPS)
            outs.append(out)
        cols, again, rows = outs
        assert not cols.isnan().any()
        assert torch.equal(cols, again)
        assert int(combine._row_counters(cols.device)[:m].abs().sum()) == 0
        if norm:
            assert (cols.float() - rows.float()).abs().max() <= rows.float().abs().max() * 2 ** -7
            _, y_n64 = _reference64(pairs if split > 1 else pairs[None], ids, weights, rms)
            assert float((cols.double() - y_n64).norm() / y_n64.norm()) < 8e-3
        else:
            assert torch.equal(cols, rows)
        if m > 1:
            assert torch.equal(cols[-1], torch.zeros_like(cols[-1]))


def test_column_chunk_choice_and_bad_override(monkeypatch):
    from latent_moe_fusion.ops.triton_kernels import combine

    monkeypatch.delenv(combine.COLS_ENV, raising=False)
    assert combine.cols_chunk(1, 3584) == combine.COLS_CHUNK == 0  # measured slower: off by default
    monkeypatch.setenv(combine.COLS_ENV, "128")
    assert combine.cols_chunk(1, 3584) == 128
    assert combine.cols_chunk(combine.COLS_MAX_ROWS + 1, 3584) == 0  # enough row programs
    assert combine.cols_chunk(1, 128) == 0  # one chunk: the row kernel
    monkeypatch.setenv(combine.COLS_ENV, "0")
    assert combine.cols_chunk(1, 3584) == 0
    monkeypatch.setenv(combine.COLS_ENV, "x")
    with pytest.raises(ValueError, match="LMF_COMBINE_COLS='x'"):
        combine.cols_chunk(1, 3584)
    monkeypatch.setenv(combine.COLS_ENV, "100")
    with pytest.raises(ValueError, match="LMF_COMBINE_COLS='100': expected 0 or a power of two >= 16"):
        combine.cols_chunk(1, 3584)
