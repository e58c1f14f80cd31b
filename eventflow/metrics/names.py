"""The names of the metrics eventflow exports (DESIGN 8), in one place: the registry uses
them, the docs list them and the Grafana dashboard's test checks its queries against them.

Labels: ``group`` (the consumer group) and ``topic`` (the subscription's topic pattern, as
in ``@subscribe("order.*")``: the unit the broker keeps lag for), ``projection``, ``saga``
(a saga class's name) and ``status``: names, never ids.
"""

from __future__ import annotations

__all__ = [
    "APPEND_CONFLICTS",
    "COLLECT_ERRORS",
    "CONSUMER_COUNTERS",
    "COUNTERS",
    "DEAD_LETTERS",
    "END_TO_END",
    "EXPORTED",
    "GAUGES",
    "HANDLER_DURATION",
    "HISTOGRAMS",
    "LAG_MESSAGES",
    "LAG_SECONDS",
    "OUTBOX_OLDEST",
    "OUTBOX_PENDING",
    "PARTITION_LAG_MESSAGES",
    "PARTITION_LAG_SECONDS",
    "PROJECTION_LAG_POSITIONS",
    "PROJECTION_LAG_SECONDS",
    "READY",
    "SAGAS",
    "TIMERS_OVERDUE",
    "TIMERS_PENDING",
]

# Counters fed from each consumer's ConsumerStats at scrape time: name -> (stats field, help).
CONSUMER_COUNTERS: dict[str, tuple[str, str]] = {
    "eventflow_messages_received_total": ("received", "Deliveries the consumer fetched."),
    "eventflow_messages_handled_total": ("handled", "Messages handled to completion (acked)."),
    "eventflow_messages_failed_total": (
        "failed",
        "Handler attempts that failed (raised or timed out), retried or dead-lettered after.",
    ),
    "eventflow_messages_retried_total": ("retries", "Failed attempts followed by another."),
    "eventflow_messages_dead_lettered_total": (
        "dead_lettered",
        "Messages filed in the dead-letter queue (bad input, exhausted retries, rejections).",
    ),
    "eventflow_messages_deduplicated_total": (
        "duplicates",
        "Deliveries skipped because the group had handled the message already.",
    ),
    "eventflow_messages_given_back_total": (
        "given_back",
        "Messages given back untouched after a failure around the handler (no attempt spent).",
    ),
    "eventflow_messages_limited_total": (
        "limited",
        "Messages given back by a limit (breaker open, no slot in time): no attempt spent.",
    ),
}

HANDLER_DURATION = "eventflow_handler_duration_seconds"
END_TO_END = "eventflow_message_end_to_end_seconds"
HISTOGRAMS: dict[str, str] = {
    HANDLER_DURATION: "Seconds one handler attempt took (failed attempts included).",
    END_TO_END: (
        "Seconds from a message's publish (its envelope time) to its handling's end, "
        "retries included."
    ),
}

LAG_MESSAGES = "eventflow_consumer_lag_messages"
LAG_SECONDS = "eventflow_consumer_lag_seconds"
PARTITION_LAG_MESSAGES = "eventflow_consumer_partition_lag_messages"
PARTITION_LAG_SECONDS = "eventflow_consumer_partition_lag_seconds"
OUTBOX_PENDING = "eventflow_outbox_pending_messages"
OUTBOX_OLDEST = "eventflow_outbox_oldest_seconds"
PROJECTION_LAG_POSITIONS = "eventflow_projection_lag_positions"
PROJECTION_LAG_SECONDS = "eventflow_projection_lag_seconds"
DEAD_LETTERS = "eventflow_dead_letter_queue_messages"
SAGAS = "eventflow_sagas"
TIMERS_PENDING = "eventflow_saga_timers_pending"
TIMERS_OVERDUE = "eventflow_saga_timers_overdue_seconds"
APPEND_CONFLICTS = "eventflow_store_append_conflicts_total"
READY = "eventflow_ready"
COLLECT_ERRORS = "eventflow_metrics_collect_errors_total"

GAUGES: dict[str, str] = {
    LAG_MESSAGES: (
        "Messages of the group on the topic pattern not yet handled, across every member "
        "(the broker's count: Kafka end offset minus committed, NATS pending plus ack pending)."
    ),
    LAG_SECONDS: "Age in seconds of the oldest message the group has not handled yet (0: none).",
    PARTITION_LAG_MESSAGES: (
        "The group's lag in messages on one partition (NATS: its number; Kafka: topic/number)."
    ),
    PARTITION_LAG_SECONDS: (
        "Age in seconds of the group's oldest unhandled message on one partition (0: none)."
    ),
    OUTBOX_PENDING: "Messages committed to the store's outbox and not yet relayed (up to 1000).",
    OUTBOX_OLDEST: "Age in seconds of the oldest message waiting in the outbox (0: none).",
    PROJECTION_LAG_POSITIONS: "Events in the store past the projection's checkpoint.",
    PROJECTION_LAG_SECONDS: "Age in seconds of the oldest event the projection has not handled.",
    DEAD_LETTERS: "Dead letters kept in the store, per group.",
    SAGAS: "Sagas in the store, per saga class and status.",
    TIMERS_PENDING: "Saga timers set and not fired, per saga class (up to 1000).",
    TIMERS_OVERDUE: "Seconds the most overdue saga timer is past its due time (0: none due).",
    READY: "1 when /readyz would answer ready (started, every component well), else 0.",
}

COUNTERS: dict[str, str] = {
    APPEND_CONFLICTS: (
        "Appends eventflow itself made that found their stream changed by another "
        "(saga transitions racing; applied again): user Repository conflicts surface as "
        "handler failures instead."
    ),
    COLLECT_ERRORS: "Scrape-time reads (lag, DLQ, outbox, ...) that failed, per part.",
}

EXPORTED: frozenset[str] = frozenset(
    [*CONSUMER_COUNTERS, *GAUGES, *COUNTERS]
    + [f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")]
)
"""Every sample name ``/metrics`` can carry."""
