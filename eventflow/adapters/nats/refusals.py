"""Publishes the NATS server refused this client (permission violations).

A publish to a subject the user may not publish to only times out on the client; the
server says why in an asynchronous error. The broker records each refusal per topic here
(its subjects differ by partition) so the next publish to the topic raises at once.
"""

from __future__ import annotations

import asyncio
import re

from ...errors import MessageRefusedError

__all__ = ["Refusals"]

_DENIED = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)
_DENIED_FOR = 60.0
"""Seconds a refusal is believed (permissions may change with a server reload)."""
_MAX_DENIED = 1024


class Refusals:
    """The topics the server refused this client a publish to lately."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._denied: dict[str, float] = {}  # topic -> when the server refused a publish

    def note(self, error: Exception) -> None:
        """Record the topic of ``error`` if it is a publish permission violation."""
        denied = _DENIED.search(str(error))
        if denied is None:
            return
        subject, head = denied.group(1), f"{self._prefix}."
        topic = subject[len(head) :].partition(".")[2] if subject.startswith(head) else ""
        if topic:
            if len(self._denied) >= _MAX_DENIED:
                self._denied.clear()
            self._denied[topic] = asyncio.get_running_loop().time()

    def check(self, topic: str) -> None:
        """Raise ``MessageRefusedError`` if the server refused a publish to ``topic`` in
        the last ``_DENIED_FOR`` seconds."""
        at = self._denied.get(topic)
        if at is None:
            return
        if asyncio.get_running_loop().time() - at > _DENIED_FOR:
            del self._denied[topic]
            return
        raise MessageRefusedError(
            f"NATS refuses this client publishing to {topic!r} (a permissions violation on "
            f"its subjects {self._prefix}.<partition>.{topic}); it is not retried: "
            "grant the user publish permission on them in the server's configuration"
        )
