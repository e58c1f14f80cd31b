"""The PostgreSQL store's sequencer and listener: positions for committed events, and news.

Appends only insert events. The sequencer (``ef_sequence_v3``, run by every open store, one
at a time under an advisory lock) gives the events committed since its last pass the next
positions, in insertion order, as runs of consecutive ids in ``ef_runs``, and notifies
``ef_sequenced``; ids it could not see yet (writers still running) it keeps and looks up
again on later passes. See docs/event-store.md.

:class:`Sequencer` runs the passes of one store (woken by its own appends, and every
``_SEQUENCER_POLL`` for other processes' ones) and keeps the listener connection that hears
``ef_sequenced`` (and the store's other channels: lease releases, outbox adds), both as
components of a supervisor.
Readers call :func:`number_committed` themselves before a read, so they never wait for a pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import asyncpg

from ..._logging import Throttled
from ...errors import StoreError
from ...supervision import Component, Supervisor
from .db import PostgresDatabase

__all__ = ["Sequencer", "number_committed"]

_log = logging.getLogger("eventflow.postgres")
_SEQUENCE_BATCH = 10_000
_SEQUENCER_POLL = 0.2  # seconds between checks for events appended by other processes
_COALESCE = 0.01  # seconds the sequencer waits after a wake-up, to sequence in batches
# A pass costs the server about the same whatever it numbers (half a millisecond of CPU,
# mostly planning, executor start-up and its commit): while the wait keeps gathering more
# appends and passes keep finding at least _BUSY_PASS events, the wait doubles, up to
# _COALESCE_MAX, so a busy store is numbered in fewer, larger passes; any other pass brings
# it back to _COALESCE (a longer wait that gathers nothing would only add latency).
_COALESCE_MAX = 0.05
_BUSY_PASS = 100
_SEQUENCE = "SELECT ef_sequence_v3($1)"


async def number_committed(conn: Any) -> int:
    """Run sequencer passes (on a connection or the pool) until every event committed now
    is numbered; return about how many were (a pass numbers at most ``_SEQUENCE_BATCH``
    ids, and returns at least that when there may be more)."""
    numbered = 0
    while (n := await conn.fetchval(_SEQUENCE, _SEQUENCE_BATCH)) >= _SEQUENCE_BATCH:
        numbered += n
    return numbered + int(n)


def _payload_to(callback: Callable[[str], None]) -> Callable[..., None]:
    """An asyncpg notification listener that passes the payload to ``callback``."""

    def listener(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
        callback(payload)

    return listener


class Sequencer:
    """The sequencer passes and the listener connection of one store on ``db``.

    ``channels`` are the other notification channels the listener follows (the leases'
    releases, the outbox's adds), each with the callback given the payload; ``reconnected``
    callbacks are called once the listener connected again after it was lost, since what
    was notified meanwhile never arrives. ``tick`` is a future resolved at the next
    ``ef_sequenced`` notification (None while stopped): subscribers wait on it.
    """

    def __init__(
        self,
        db: PostgresDatabase,
        channels: Mapping[str, Callable[[str], None]] | None = None,
        reconnected: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.db = db
        self._channels = dict(channels or {})
        self._reconnected = tuple(reconnected)
        self._pending = asyncio.Event()
        self._appends = 0  # appends committed by this process (the passes' pacing)
        self.tick: asyncio.Future[None] | None = None
        self.listener: Any = None
        """The listener connection (None while stopped or reconnecting)."""
        self._supervisor: Supervisor | None = None
        self._own_supervisor = False
        self._passes: Component | None = None
        self._listening: Component | None = None
        self._throttled = Throttled(_log)

    async def start(self, supervisor: Supervisor | None) -> None:
        """Connect the listener (failing within ``connect_timeout``), then run the passes
        and the listener as components of ``supervisor``, or of a supervisor of its own."""
        loop = asyncio.get_running_loop()
        self.tick = loop.create_future()
        # A fresh event per start: one the passes waited on is bound to that start's loop,
        # and a store is opened again in another (`eventflow status --watch`, each round).
        self._pending = asyncio.Event()
        await self._listen()  # the first connection fails open() within connect_timeout
        # Components of the owner's supervisor (the app's), or of the store's own: started
        # in open(), stopped in close().
        self._own_supervisor = supervisor is None
        self._supervisor = supervisor or Supervisor(f"store {self.db.config.schema}")
        try:
            self._listening = self._supervisor.spawn("postgres listener", self._keep_listening)
            self._passes = self._supervisor.spawn("postgres sequencer", self._sequence_loop)
        except BaseException:
            await self.stop()
            raise
        self._pending.set()  # sequence whatever a crashed process left behind

    async def stop(self) -> None:
        """Stop the components and close the listener connection."""
        components = (self._passes, self._listening)
        self._passes = self._listening = None
        for component in components:
            if component is not None:
                await component.stop()
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and self._own_supervisor:
            await supervisor.close()
        listener, self.listener = self.listener, None
        if listener is not None:
            try:
                await asyncio.wait_for(listener.close(), 1.0)
            except Exception:  # already broken
                listener.terminate()

    def appended(self) -> None:
        """Wake the passes (after a transaction with an append committed)."""
        self._appends += 1
        self._pending.set()

    async def _listen(self) -> None:
        """Open the listener connection and follow the store's channels on it."""
        cfg = self.db.config
        conn = await self.db.connect(
            "listen for appended events", server_settings={"search_path": cfg.schema}
        )
        try:
            await conn.add_listener("ef_sequenced", self._on_sequenced)
            for channel, callback in self._channels.items():
                await conn.add_listener(channel, _payload_to(callback))
        except BaseException:
            conn.terminate()
            raise
        self.listener = conn

    async def _keep_listening(self) -> None:
        """A component: while the listener connection lives, wait; once it is lost (a server
        restart, ``pg_terminate_backend``), fail, so the supervisor starts this again, which
        connects anew. Until then subscribers and lease contenders poll."""
        listener = self.listener
        if listener is None or listener.is_closed():
            self.listener = None
            await self._listen()
            listener = self.listener
            self._on_sequenced()  # what was notified meanwhile is lost: read again
            self._pending.set()
            for callback in self._reconnected:
                callback()
        lost = asyncio.Event()
        listener.add_termination_listener(lambda _conn: lost.set())
        if listener.is_closed():
            lost.set()
        await lost.wait()
        raise StoreError(
            "the PostgreSQL listener connection was lost; reconnecting (meanwhile new events "
            "and lease releases are found by polling, within a second)"
        )

    def _on_sequenced(self, *_: Any) -> None:
        tick = self.tick
        if tick is not None and not tick.done():
            self.tick = asyncio.get_running_loop().create_future()
            tick.set_result(None)

    async def _sequence_loop(self) -> None:
        pool = self.db.pool
        pause = _COALESCE
        while True:
            gathered = False
            try:
                async with asyncio.timeout(_SEQUENCER_POLL):
                    await self._pending.wait()
            except TimeoutError:
                # Events other processes appended and have not numbered (they may have died),
                # or ids still waiting for their writer: ef_sequence_v3 returns at once if none.
                pass
            else:
                woke_at = self._appends
                await asyncio.sleep(pause)  # let concurrent appends join this pass
                gathered = self._appends > woke_at
            self._pending.clear()
            try:
                numbered = await number_committed(pool)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                # The server is restarting or the network is down: the pool reconnects.
                self._throttled.warning("pass", "sequencer pass failed (%s); retrying", exc)
                await asyncio.sleep(_SEQUENCER_POLL)
                self._pending.set()
                continue
            self._throttled.clear("pass")
            busy = gathered and numbered >= _BUSY_PASS
            pause = min(pause * 2, _COALESCE_MAX) if busy else _COALESCE
