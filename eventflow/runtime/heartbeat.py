"""The heartbeat of a running app: one record per instance, refreshed every few seconds."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from .._logging import Throttled
from ..ports import Heartbeat, Heartbeats
from ..supervision import Health

__all__ = ["DEFAULT_HEARTBEAT_INTERVAL", "Heartbeater"]

DEFAULT_HEARTBEAT_INTERVAL = 5.0
_log = logging.getLogger("eventflow.heartbeat")


class Heartbeater:
    """Writes the app instance's heartbeat every ``interval`` seconds until cancelled, with
    the app's health (``health()``: ok, degraded or failed, and what is not well)."""

    def __init__(
        self,
        store: Heartbeats,
        app: str,
        instance: str,
        subscriptions: tuple[str, ...],
        stats: Callable[[], Mapping[str, int]],
        interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        *,
        health: Callable[[], Health] | None = None,
    ) -> None:
        self.store = store
        self.app = app
        self.instance = instance
        self.subscriptions = subscriptions
        self.stats = stats
        self.interval = interval
        self.health = health or (lambda: Health("ok"))
        self.started_at = datetime.now(UTC)
        self.host = socket.gethostname()
        self.pid = os.getpid()

    async def beat(self, health: Health | None = None) -> None:
        """Write one heartbeat now (with ``health``, or the app's current health)."""
        health = health or self.health()
        await self.store.beat(
            Heartbeat(
                app=self.app,
                instance=self.instance,
                host=self.host,
                pid=self.pid,
                started_at=self.started_at,
                last_seen=datetime.now(UTC),
                subscriptions=self.subscriptions,
                stats=dict(self.stats()),
                health=health.status,
                problems=health.problems,
            )
        )

    async def run(self) -> None:
        """Beat forever; a failed write is logged (rate-limited) and retried at the next
        beat: an instance whose store is down goes stale in ``eventflow status``."""
        throttled = Throttled(_log)
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except Exception as exc:  # liveness reporting must not stop the app
                throttled.warning("beat", "heartbeat of %s failed: %s", self.instance, exc)
            else:
                throttled.clear("beat")
