"""bench/common.upper_median: the figure every timing helper reports is a measured sample."""

from bench.common import upper_median


def test_upper_median_is_a_sample():
    assert upper_median([3.0, 1.0, 2.0]) == 2.0
    assert upper_median([4.0, 1.0, 3.0, 2.0]) == 3.0  # the upper middle, not 2.5
    assert upper_median([7.5]) == 7.5
