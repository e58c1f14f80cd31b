"""``Buckets``: a histogram's counts kept as plain numbers, observed on the hot path.

``prometheus_client``'s ``Histogram.observe`` takes a lock per bucket it bumps (it may be
called from any thread); a consumer's observations all happen on its event loop, so one
``bisect`` and two additions do, and the scrape (on the same loop) turns the counts into a
cumulative histogram family. Nothing here imports ``prometheus_client``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable

__all__ = ["DURATION_BUCKETS", "END_TO_END_BUCKETS", "Buckets"]

DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Handler attempt buckets, in seconds."""
END_TO_END_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)
"""Publish-to-handled buckets, in seconds (they include retries and time spent queued)."""


class Buckets:
    """Counts of observations per upper bound (and above the last one), and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is at least ``value``."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, count of observations <= le)`` pairs, ``+Inf`` last, as Prometheus wants."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((_le(bound), float(running)))
        out.append(("+Inf", float(running + self.counts[-1])))
        return out


def _le(bound: float) -> str:
    """A bucket bound as ``prometheus_client`` writes it (``0.5``, ``1.0``, ``10.0``)."""
    return repr(float(bound))
