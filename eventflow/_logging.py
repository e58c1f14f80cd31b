"""Rate-limited logging for conditions that repeat while they last (a broker that is down,
a store that refuses connections): the first occurrence is logged at once, the next ones at
most once per interval, with the number left out in between."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["DEFAULT_LOG_INTERVAL", "Throttled"]

DEFAULT_LOG_INTERVAL = 30.0
"""Seconds between two records of one recurring condition."""
_MAX_KEYS = 1024


class Throttled:
    """Logs through ``logger``, each ``key`` at most once per ``interval`` seconds.

    ``key`` names the condition (``"reconnect"``, a component's name); a record that follows
    suppressed ones says how many were left out. ``clear(key)`` (the condition ended) makes
    the next occurrence log at once.
    """

    def __init__(self, logger: logging.Logger, interval: float = DEFAULT_LOG_INTERVAL) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}  # key -> (logged at, suppressed since)

    def log(self, level: int, key: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval`` ago; return
        whether it was logged."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval:
            self._last[key] = (last[0], last[1] + 1)
            return False
        if last is not None and last[1]:
            msg = f"{msg} ({last[1]} similar messages in the last {now - last[0]:.0f}s)"
        if len(self._last) >= _MAX_KEYS and key not in self._last:
            self._last.clear()  # keys are conditions, not ids: this only guards a misuse
        self._last[key] = (now, 0)
        self.logger.log(level, msg, *args, **kwargs)
        return True

    def warning(self, key: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        """``log`` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args, **kwargs)

    def error(self, key: str, msg: str, *args: Any, **kwargs: Any) -> bool:
        """``log`` at ERROR."""
        return self.log(logging.ERROR, key, msg, *args, **kwargs)

    def clear(self, key: str) -> None:
        """The condition named ``key`` ended: its next occurrence is logged at once."""
        self._last.pop(key, None)
