"""``AppMetrics``: one app's metrics in a ``prometheus_client`` registry.

Counters are read from the consumers' ``ConsumerStats`` when Prometheus scrapes (the
pipeline counts them anyway, so exporting them costs nothing per message); the handler
duration and end-to-end histograms are observed per message through the consumer's
``observe`` hook into plain :class:`~eventflow.metrics.histogram.Buckets` (one
``perf_counter`` pair, a ``bisect`` and two additions: ``prometheus_client``'s own
``Histogram`` takes a lock per bucket, which cost a tenth of the memory broker's
throughput) and turned into histogram families at scrape time; the
gauges that ask the broker or the store (lag, DLQ, outbox, projections, sagas) come from
the :class:`~eventflow.metrics.collect.Sampler`, read at scrape time. Importing this
module needs the ``prometheus`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from ..runtime.consumer import Consumer
from ..sagas.runtime import SagaRuntime
from . import names
from .collect import DEFAULT_MIN_INTERVAL, DEFAULT_TIMEOUT, MetricsHost, Sampler
from .histogram import DURATION_BUCKETS, END_TO_END_BUCKETS, Buckets

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import generate_latest
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "eventflow's Prometheus metrics need prometheus-client: pip install 'eventflow[prometheus]'"
    ) from exc

__all__ = ["AppMetrics"]

_LABELS = ("group", "topic")


class AppMetrics:
    """The metrics of one ``App`` (made by ``App(metrics=True)`` or an ``http_port``):
    ``registry`` holds them; :meth:`exposition` refreshes the gauges and renders the
    Prometheus text format, as ``/metrics`` serves it."""

    def __init__(
        self,
        app: MetricsHost,
        sagas: SagaRuntime | None = None,
        *,
        registry: CollectorRegistry | None = None,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.app = app
        self.registry = registry if registry is not None else CollectorRegistry()
        self.sampler = Sampler(app, sagas, min_interval=min_interval, timeout=timeout)
        # (group, topic pattern) -> buckets; kept across restarts of the app, as counters
        # of a process are.
        self.durations: dict[tuple[str, str], Buckets] = {}
        self.end_to_end: dict[tuple[str, str], Buckets] = {}
        self.registry.register(_Collector(self))

    def hooks(self, consumer: Consumer) -> tuple[Callable[[float], None], Callable[[float], None]]:
        """The per-message observers of ``consumer`` (attempt seconds, end-to-end seconds);
        its histogram series exist from then on."""
        key = (consumer.group, consumer.spec.pattern)
        duration = self.durations.setdefault(key, Buckets(DURATION_BUCKETS))
        end_to_end = self.end_to_end.setdefault(key, Buckets(END_TO_END_BUCKETS))
        return duration.observe, end_to_end.observe

    async def exposition(self) -> tuple[bytes, str]:
        """Refresh the scrape-time gauges (see ``Sampler``) and return the body and content
        type of a ``/metrics`` answer."""
        await self.sampler.refresh()
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Collector:
    """Yields the counters from the consumers' stats and the gauges of the last sample.
    ``collect`` only reads numbers (it calls nothing of the event loop), so a registry
    served from another thread works, showing the gauges of the last ``exposition``."""

    def __init__(self, metrics: AppMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        yield _histogram(names.HANDLER_DURATION, metrics.durations)
        yield _histogram(names.END_TO_END, metrics.end_to_end)
        app = metrics.app
        consumers = app.consumers
        for name, (stat, text) in names.CONSUMER_COUNTERS.items():
            family = CounterMetricFamily(name, text, labels=_LABELS)
            for c in consumers:
                family.add_metric([c.group, c.spec.pattern], getattr(c.stats, stat))
            yield family
        sample = self._metrics.sampler.sample
        lag = sample.lag
        yield _gauge(names.LAG_MESSAGES, _LABELS, ((k, v[0]) for k, v in lag.items()))
        yield _gauge(names.LAG_SECONDS, _LABELS, ((k, v[1]) for k, v in lag.items()))
        parts, part_labels = sample.partition_lag, (*_LABELS, "partition")
        yield _gauge(
            names.PARTITION_LAG_MESSAGES, part_labels, ((k, v[0]) for k, v in parts.items())
        )
        yield _gauge(
            names.PARTITION_LAG_SECONDS, part_labels, ((k, v[1]) for k, v in parts.items())
        )
        letters = sample.dead_letters
        yield _gauge(names.DEAD_LETTERS, ("group",), (((g,), n) for g, n in letters.items()))
        yield _gauge(names.OUTBOX_PENDING, (), [((), sample.outbox[0])])
        yield _gauge(names.OUTBOX_OLDEST, (), [((), sample.outbox[1])])
        projections = sample.projections
        yield _gauge(
            names.PROJECTION_LAG_POSITIONS,
            ("projection",),
            (((p,), v[0]) for p, v in projections.items()),
        )
        yield _gauge(
            names.PROJECTION_LAG_SECONDS,
            ("projection",),
            (((p,), v[1]) for p, v in projections.items()),
        )
        yield _gauge(names.SAGAS, ("saga", "status"), sample.sagas.items())
        timers = sample.timers
        yield _gauge(names.TIMERS_PENDING, ("saga",), (((s,), v[0]) for s, v in timers.items()))
        yield _gauge(names.TIMERS_OVERDUE, ("saga",), (((s,), v[1]) for s, v in timers.items()))
        yield _gauge(names.READY, (), [((), 1.0 if sample.ready else 0.0)])
        conflicts = CounterMetricFamily(
            names.APPEND_CONFLICTS, names.COUNTERS[names.APPEND_CONFLICTS]
        )
        conflicts.add_metric([], self._metrics.sampler.conflicts)
        yield conflicts
        errors = CounterMetricFamily(
            names.COLLECT_ERRORS, names.COUNTERS[names.COLLECT_ERRORS], labels=("part",)
        )
        for part, n in sample.errors.items():
            errors.add_metric([part], n)
        yield errors


def _histogram(name: str, series: dict[tuple[str, str], Buckets]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, names.HISTOGRAMS[name], labels=_LABELS)
    for key, buckets in series.items():
        family.add_metric(list(key), buckets.cumulative(), buckets.sum)
    return family


def _gauge(
    name: str, labels: Sequence[str], values: Iterable[tuple[Any, float]]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, names.GAUGES[name], labels=labels)
    for key, value in values:
        family.add_metric(list(key), value if value is not None else math.nan)
    return family
