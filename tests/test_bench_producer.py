"""bench/producer.py on the CPU: its size and routing arguments (a bad value is one usage line and exit code 2), the
routing each size runs, the rows it checks against the reference, and the floors it quotes. The timings need the
H200."""

from __future__ import annotations

import pytest
import torch

from bench import producer

BAD = [
    (["--m", "0"], "argument --m: expected an integer >= 1, got 0"),
    (["--m", "-4096"], "argument --m: expected an integer >= 1, got -4096"),
    (["--m", "abc"], "argument --m: expected an integer >= 1, got 'abc'"),
    (["--m", "4096", "8k"], "argument --m: expected an integer >= 1, got '8k'"),
    (["--m"], "argument --m: expected at least one argument"),
    (["--m", "4096", "--quick"], "argument --quick: not allowed with argument --m"),
    (["--routing", "all_local"], "argument --routing: invalid choice: 'all_local'"),
    (["--name", "results/producer"], "--name 'results/producer': expected a file stem"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        producer.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and message in err, err
    assert "Traceback" not in err


def test_m_takes_the_prefill_sizes_once_each_in_order():
    args = producer.parse_args(["--m", "4096", "8192", "16384", "32768", "8192", "--out", "somewhere"])
    assert args.m == [4096, 8192, 16384, 32768] and args.name == "producer"


def test_without_m_the_default_sizes_and_routing_stay():
    assert producer.row_plan(producer.parse_args([])) == [
        (1, "decode", "eight_global"), (8, "decode", "eight_global"), (32, "decode", "eight_global"),
        (128, "decode", "eight_global"), (512, "prefill", "eight_global"), (4096, "prefill", "eight_global")]
    assert [m for m, _, _ in producer.row_plan(producer.parse_args(["--quick"]))] == [1, 32, 512]


def test_with_m_prefill_sizes_take_the_blocks_routing():
    plan = producer.row_plan(producer.parse_args(["--m", "32", "128", "129", "4096", "32768"]))
    assert plan == [(32, "decode", "eight_global"), (128, "decode", "eight_global"), (129, "prefill", "ep_share"),
                    (4096, "prefill", "ep_share"), (32768, "prefill", "ep_share")]
    for forced in producer.ROUTINGS:
        plan = producer.row_plan(producer.parse_args(["--m", "8", "4096", "--routing", forced]))
        assert [r for _, _, r in plan] == [forced, forced]
    assert [r for _, _, r in producer.row_plan(producer.parse_args(["--routing", "ep_share"]))] == ["ep_share"] * 6


def test_floor_terms_count_bytes_and_flops_of_a_small_shape():
    shape = dict(latent=64, inter=32, hidden=128, inter_s=16, top_k=2)
    m, hit, pairs = 4, 3, 5
    # activations: z read + y written (L each), x read + shared out written (H each), BF16; ids + router weights
    # (4 + 4 bytes a slot); the RMSNorm weight (L BF16)
    activations = 4 * (64 + 128) * 2 * 2 + 4 * 2 * 8 + 64 * 2
    shared = 3 * 128 * 16 * 2  # gate, up [I_s, H] and down [H, I_s], BF16
    flops = 2 * 5 * 3 * 32 * 64 + 2 * 4 * 3 * 128 * 16  # routed per pair + shared per row
    mxfp4_expert = 3 * 32 * 64 // 2 + 3 * 32 * 64 // 32  # codes two a byte + one E8M0 scale per 32
    assert producer.floor_terms(m, hit, pairs, "mxfp4", **shape) == (3 * mxfp4_expert + shared + activations, flops)
    bf16_expert = 3 * 32 * 64 * 2
    assert producer.floor_terms(m, hit, pairs, "bf16", **shape) == (3 * bf16_expert + shared + activations, flops)
    assert (activations, shared, flops, mxfp4_expert) == (3264, 12288, 110592, 3264)


def test_the_binding_floor_is_the_larger_and_named():
    ceilings = {"copy_bytes_per_s": 1e12, "bf16_flop_per_s": 1e15}
    assert producer.floors_us(2e6, 1e9, ceilings) == pytest.approx(
        {"bytes_floor_us": 2.0, "flop_floor_us": 1.0, "floor_us": 2.0, "bound": "bytes"})
    assert producer.floors_us(1e6, 3e9, ceilings) == pytest.approx(
        {"bytes_floor_us": 1.0, "flop_floor_us": 3.0, "floor_us": 3.0, "bound": "FLOPs"})


@pytest.mark.parametrize(("m", "pairs_per_row", "bound"), [(1, 12.5, "bytes"), (4096, 2.0, "FLOPs"),
                                                          (32768, 2.0, "FLOPs")])
def test_kimi_k3_decode_is_bound_by_bytes_and_prefill_by_flops(m, pairs_per_row, bound):
    """H200-like ceilings (4.2 TB/s copy, 800 TFLOP/s BF16), MXFP4 experts, every local expert hit at prefill."""
    ceilings = {"copy_bytes_per_s": 4.2e12, "bf16_flop_per_s": 8e14}
    hit = min(112, m * pairs_per_row)
    nbytes, flops = producer.floor_terms(m, hit, m * pairs_per_row, "mxfp4")
    assert flops == 2 * m * pairs_per_row * 3 * 3072 * 3584 + 2 * m * 3 * 7168 * 768
    assert producer.floors_us(nbytes, flops, ceilings)["bound"] == bound


def test_large_m_is_checked_on_rows_spread_over_the_batch():
    assert producer.check_rows(producer.CHECK_ROWS) is None and producer.check_rows(1) is None
    rows = producer.check_rows(32768)
    assert rows.numel() == producer.CHECK_ROWS and rows.dtype == torch.int64
    assert int(rows[0]) == 0 and int(rows[-1]) == 32767 and bool((rows.diff() > 0).all())


def test_the_routings_on_the_cpu():
    gen = torch.Generator().manual_seed(0)
    for kind, m, low, high in (("ep_share", 4096, 1.8, 2.2), ("eight_global", 256, 10.0, 16.0)):
        ids, weights = producer.routed_ids(kind, m, gen)
        assert ids.shape == weights.shape == (m, producer.TOP_K)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert int(ids.min()) >= -1 and int(ids.max()) < producer.LOCAL_EXPERTS
        local = ids >= 0
        assert low < float(local.sum(1).float().mean()) < high, kind  # ~2 local pairs a token; ~8x that
        for row in ids[:64]:  # distinct local experts in each row
            valid = row[row >= 0]
            assert valid.unique().numel() == valid.numel()
    with pytest.raises(ValueError, match="routing 'all_local'"):
        producer.routed_ids("all_local", 8, gen)
