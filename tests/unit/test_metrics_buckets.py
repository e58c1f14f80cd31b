"""``Buckets``: a histogram kept as plain counts, exported cumulative as Prometheus wants."""

from __future__ import annotations

from eventflow.metrics.histogram import Buckets


def test_an_observation_counts_in_the_first_bucket_whose_bound_is_at_least_it() -> None:
    b = Buckets([0.1, 1, 10])
    for v in (0.05, 0.1, 0.5, 1.0, 50.0):
        b.observe(v)
    assert b.cumulative() == [("0.1", 2.0), ("1.0", 4.0), ("10.0", 4.0), ("+Inf", 5.0)]
    assert b.sum == 0.05 + 0.1 + 0.5 + 1.0 + 50.0


def test_no_observation_gives_zero_everywhere() -> None:
    assert Buckets([2, 1]).cumulative() == [("1.0", 0.0), ("2.0", 0.0), ("+Inf", 0.0)]
