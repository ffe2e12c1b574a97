"""The claim behind producer_notes.md run 17 (bench/dequant_encodings.py): no repacking of an MXFP4 word's bits
lets every pair of codes expand with a rotate and a mask, and the bits left by three rotated pairs never hold the
fourth pair's three magnitude bits in one run."""

from bench.dequant_encodings import PAIR_BITS, rotated, runs, tilings


def test_no_four_rotations_tile_a_word_and_three_leave_split_magnitudes():
    assert len(PAIR_BITS) == 8 and rotated(0) == frozenset(PAIR_BITS)
    assert tilings(4) == []
    three = tilings(3)
    assert three and any(0 in ts for ts in three)  # one pair can stay in place
    for ts in three:
        left = set(range(32)) - set().union(*(rotated(t) for t in ts))
        assert len(left) == 8 and max(runs(left)) < 3, (ts, sorted(left))
