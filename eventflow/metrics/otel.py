"""``OtelMetrics``: the same metrics through an OpenTelemetry ``MeterProvider``
(``App(meter_provider=provider)``; needs ``opentelemetry-api``, and an SDK to export).

Instrument names are the Prometheus ones without the suffixes an OTel Prometheus exporter
adds back (``eventflow_messages_handled`` counter -> ``eventflow_messages_handled_total``;
``eventflow_handler_duration`` in ``s`` -> ``eventflow_handler_duration_seconds``), with
the same attributes (``group``, ``topic``, ``partition``, ...), so a dashboard reads either.

- counters: observable counters read from the consumers' ``ConsumerStats`` when the reader
  collects (nothing per message);
- histograms: recorded per message (the OTel SDK's ``record``, with the consumer's
  attributes built once);
- gauges (lag, DLQ, outbox, projections, sagas): observable gauges reading the sampler's
  last reading, which the app's "metrics sampler" component refreshes every
  ``interval`` seconds (the reader's callbacks run on its own thread, away from the loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..runtime.consumer import Consumer
from . import names
from .collect import Sampler
from .histogram import DURATION_BUCKETS, END_TO_END_BUCKETS

try:
    from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
except ImportError as exc:  # pragma: no cover - exercised without the package
    raise ImportError(
        "App(meter_provider=...) needs opentelemetry-api: pip install 'eventflow[otel]'"
    ) from exc

__all__ = ["DEFAULT_INTERVAL", "OtelMetrics"]

DEFAULT_INTERVAL = 15.0
"""Seconds between the readings the OTel gauges report (lag, DLQ, outbox, ...)."""
_LABELS = ("group", "topic")


class OtelMetrics:
    """The app's instruments on ``provider`` (see the module docstring)."""

    def __init__(
        self, sampler: Sampler, provider: MeterProvider, *, interval: float = DEFAULT_INTERVAL
    ) -> None:
        self.sampler = sampler
        self.interval = interval
        meter = provider.get_meter("eventflow")
        self._duration = meter.create_histogram(
            _base(names.HANDLER_DURATION),
            unit="s",
            description=names.HISTOGRAMS[names.HANDLER_DURATION],
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self._end_to_end = meter.create_histogram(
            _base(names.END_TO_END),
            unit="s",
            description=names.HISTOGRAMS[names.END_TO_END],
            explicit_bucket_boundaries_advisory=END_TO_END_BUCKETS,
        )
        for name, (stat, text) in names.CONSUMER_COUNTERS.items():
            meter.create_observable_counter(
                _base(name), callbacks=[self._stat(stat)], unit="{message}", description=text
            )
        gauges: Mapping[str, Callable[[], Iterable[tuple[dict[str, str], float]]]] = {
            names.LAG_MESSAGES: lambda: _keyed(_LABELS, self.sampler.sample.lag, 0),
            names.LAG_SECONDS: lambda: _keyed(_LABELS, self.sampler.sample.lag, 1),
            names.PARTITION_LAG_MESSAGES: lambda: _keyed(
                (*_LABELS, "partition"), self.sampler.sample.partition_lag, 0
            ),
            names.PARTITION_LAG_SECONDS: lambda: _keyed(
                (*_LABELS, "partition"), self.sampler.sample.partition_lag, 1
            ),
            names.DEAD_LETTERS: lambda: (
                ({"group": g}, float(n)) for g, n in dict(self.sampler.sample.dead_letters).items()
            ),
            names.OUTBOX_PENDING: lambda: [({}, self.sampler.sample.outbox[0])],
            names.OUTBOX_OLDEST: lambda: [({}, self.sampler.sample.outbox[1])],
            names.PROJECTION_LAG_POSITIONS: lambda: _keyed(
                ("projection",), _one(self.sampler.sample.projections), 0
            ),
            names.PROJECTION_LAG_SECONDS: lambda: _keyed(
                ("projection",), _one(self.sampler.sample.projections), 1
            ),
            names.SAGAS: lambda: (
                ({"saga": s, "status": st}, float(n))
                for (s, st), n in dict(self.sampler.sample.sagas).items()
            ),
            names.TIMERS_PENDING: lambda: _keyed(("saga",), _one(self.sampler.sample.timers), 0),
            names.TIMERS_OVERDUE: lambda: _keyed(("saga",), _one(self.sampler.sample.timers), 1),
            names.READY: lambda: [({}, 1.0 if self.sampler.sample.ready else 0.0)],
        }
        for name, read in gauges.items():
            meter.create_observable_gauge(
                _base(name),
                callbacks=[_observe(read)],
                unit=_unit(name),
                description=names.GAUGES[name],
            )

    async def run(self) -> None:
        """Refresh the gauges' reading every ``interval`` seconds (the app's "metrics
        sampler" component; a failing part only counts an error)."""
        while True:
            await self.sampler.refresh()
            await asyncio.sleep(self.interval)

    def hooks(self, consumer: Consumer) -> tuple[Callable[[float], None], Callable[[float], None]]:
        """The per-message observers of ``consumer``: attempt seconds, end-to-end seconds."""
        attributes = {"group": consumer.group, "topic": consumer.spec.pattern}
        duration, end_to_end = self._duration, self._end_to_end

        def attempt(seconds: float) -> None:
            duration.record(seconds, attributes)

        def handled(seconds: float) -> None:
            end_to_end.record(seconds, attributes)

        return attempt, handled

    def _stat(self, stat: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def read(options: CallbackOptions) -> Iterator[Observation]:
            for c in tuple(self.sampler.app.consumers):
                yield Observation(
                    getattr(c.stats, stat), {"group": c.group, "topic": c.spec.pattern}
                )

        return read


def _observe(
    read: Callable[[], Iterable[tuple[dict[str, str], float]]],
) -> Callable[[CallbackOptions], Iterator[Observation]]:
    def callback(options: CallbackOptions) -> Iterator[Observation]:
        for attributes, value in read():
            yield Observation(value, attributes)

    return callback


def _keyed(
    labels: tuple[str, ...], series: Mapping[Any, tuple[float, float]], index: int
) -> Iterator[tuple[dict[str, str], float]]:
    for key, values in dict(series).items():  # a copy: the loop may change it meanwhile
        yield dict(zip(labels, key, strict=True)), float(values[index])


def _one(series: Mapping[str, tuple[Any, Any]]) -> dict[tuple[str, ...], tuple[float, float]]:
    return {(k,): (float(v[0]), float(v[1])) for k, v in dict(series).items()}


def _base(name: str) -> str:
    """The instrument name: the Prometheus name without ``_total`` or a unit suffix."""
    for suffix in ("_total", "_seconds"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _unit(name: str) -> str:
    # No "1" for counts: an OTel Prometheus exporter would append "_ratio" to the name.
    return "s" if name.endswith("_seconds") else ""
