"""Rate-limited aiokafka logs.

While a Kafka broker is unreachable, aiokafka logs an error for every reconnection attempt,
metadata refresh and fetch, dozens a second for one consumer ("Unable connect to node",
"Unable to update metadata", "Failed fetch messages"). The adapter puts a filter on
aiokafka's loggers, once per process, that lets each recurring record through once per
interval (30 s, as :class:`eventflow._logging.Throttled`), the next one saying how many were
left out. A record recurs when it has the same logger, level and message template; records
below WARNING pass untouched. To see every record, remove :data:`CLIENT_LOG_THROTTLE` from
the ``aiokafka`` loggers (``logging.getLogger(name).removeFilter(CLIENT_LOG_THROTTLE)``).

One known case is dropped instead: while the adapter tries the idempotent producer with
``idempotence="auto"`` (:func:`expect_idempotence_refusal`), aiokafka's ERROR
"Unexpected error during InitProducerIdRequest" from a broker without it (Tansu, on every
start), as the adapter logs one line of its own that says what it does about it.

aiokafka's INFO records (eight or so per join or rebalance: "Joined group", "Setting newly
assigned partitions", ...) are held back too: :func:`throttle_client_logs` sets the
``aiokafka`` logger to WARNING unless a level was given to it, and the adapter logs its
own lines (a new group, a slow join, a new topic a wildcard starts reading). To see them,
``logging.getLogger("aiokafka").setLevel(logging.INFO)`` before the broker starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..._logging import DEFAULT_LOG_INTERVAL

__all__ = [
    "CLIENT_LOG_THROTTLE",
    "ClientLogThrottle",
    "expect_idempotence_refusal",
    "log_new_topics",
    "throttle_client_logs",
]

_MAX_KEYS = 1024
_SENDER = "aiokafka.producer.sender"
_INIT_PID_FAILED = "Unexpected error during InitProducerIdRequest"


class ClientLogThrottle(logging.Filter):
    """Lets a recurring WARNING-or-worse record through once per ``interval`` seconds."""

    def __init__(self, interval: float = DEFAULT_LOG_INTERVAL) -> None:
        super().__init__()
        self.interval = interval
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}
        self.expecting = 0
        """Idempotent producers being tried in ``auto`` mode now: their refusal is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for a recurrence within the interval, and for an expected refusal of the
        idempotent producer; True otherwise (the record then counts the recurrences left
        out since the last one)."""
        if record.levelno < logging.WARNING:
            return True
        if (
            self.expecting
            and record.name == _SENDER
            and str(record.msg).startswith(_INIT_PID_FAILED)
        ):
            return False
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if len(self._last) >= _MAX_KEYS and key not in self._last:
            self._last.clear()  # templates are few; this only guards against a surprise
        self._last[key] = (now, 0)
        if last is not None and last[1]:
            record.msg = (
                f"{record.msg} ({last[1]} similar messages in the last {now - last[0]:.0f}s)"
            )
        return True

    def reset(self) -> None:
        """Forget every record seen: the next of each passes at once."""
        self._last.clear()


CLIENT_LOG_THROTTLE = ClientLogThrottle()
"""The filter the adapter puts on aiokafka's loggers."""


def throttle_client_logs() -> None:
    """Put :data:`CLIENT_LOG_THROTTLE` on every ``aiokafka`` logger that exists, and set
    the ``aiokafka`` logger to WARNING if it has no level of its own. Idempotent."""
    root = logging.getLogger("aiokafka")
    if root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)
    manager = logging.Logger.manager
    names = [n for n in list(manager.loggerDict) if n == "aiokafka" or n.startswith("aiokafka.")]
    for name in ["aiokafka", *names]:
        logger = logging.getLogger(name)
        if CLIENT_LOG_THROTTLE not in logger.filters:
            logger.addFilter(CLIENT_LOG_THROTTLE)


@contextmanager
def expect_idempotence_refusal() -> Iterator[None]:
    """While inside, drop aiokafka's ERROR about a refused ``InitProducerIdRequest``: the
    caller logs what it does about it (see the module doc)."""
    CLIENT_LOG_THROTTLE.expecting += 1
    try:
        yield
    finally:
        CLIENT_LOG_THROTTLE.expecting -= 1


def log_new_topics(group: str, pattern: str, partitions: Sequence[Any], prefix_len: int) -> None:
    """Say (INFO, on ``eventflow.kafka``) which topics, created since ``group`` subscribed to
    ``pattern``, a member now reads from their beginning (``partitions``: aiokafka's)."""
    topics = sorted({tp.topic[prefix_len:] for tp in partitions})
    if topics:
        logging.getLogger("eventflow.kafka").info(
            "kafka group %r (%s): reading %s from the beginning (created since it subscribed)",
            group,
            pattern,
            ", ".join(topics),
        )
