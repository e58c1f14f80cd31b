"""The heartbeat of a running app: one record per instance, refreshed every few seconds."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from ..ports import Heartbeat, Heartbeats

__all__ = ["DEFAULT_HEARTBEAT_INTERVAL", "Heartbeater"]

DEFAULT_HEARTBEAT_INTERVAL = 5.0
_log = logging.getLogger("eventflow.heartbeat")


class Heartbeater:
    """Writes the app instance's heartbeat every ``interval`` seconds until cancelled."""

    def __init__(
        self,
        store: Heartbeats,
        app: str,
        instance: str,
        subscriptions: tuple[str, ...],
        stats: Callable[[], Mapping[str, int]],
        interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    ) -> None:
        self.store = store
        self.app = app
        self.instance = instance
        self.subscriptions = subscriptions
        self.stats = stats
        self.interval = interval
        self.started_at = datetime.now(UTC)
        self.host = socket.gethostname()
        self.pid = os.getpid()

    async def beat(self) -> None:
        """Write one heartbeat now."""
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
            )
        )

    async def run(self) -> None:
        """Beat forever; a failed write is logged and retried at the next beat."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.beat()
            except Exception as exc:  # liveness reporting must not stop the app
                _log.warning("heartbeat of %s failed: %s", self.instance, exc)
