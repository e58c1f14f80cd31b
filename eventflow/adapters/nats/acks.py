"""JetStream publish acknowledgements, many in flight on one connection.

nats-py's ``request`` makes a token, a future with a done-callback, a timeout task
(``asyncio.wait_for``) and a subscription callback per call. A publish only needs its
PubAck: :class:`PubAcks` gives each publish a reply subject ``<inbox>.<n>`` on one
wildcard subscription, keeps the unanswered ones in a dict in deadline order (insertion order
when they share one timeout) and fails the overdue ones from one timer for all, so a publish
costs a dict entry and a future, and many publishes (``app.publish`` called concurrently,
the outbox relay's batches) wait for their PubAcks at once. Each caller still awaits its
own PubAck and gets its own error; order on the connection is the order of the calls.

A PubAck lost with the connection (or never sent) ends in ``TimeoutError`` at the
deadline, which the broker retries with the same message id (the server's duplicate
window drops a copy that was stored).
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import ConnectionClosedError, NoRespondersError

__all__ = ["PubAcks"]

_STATUS = "Status"
_NO_RESPONDERS = "503"  # the status the server sends to a request nobody subscribes to


class PubAcks:
    """The PubAcks of one connection's publishes (see the module docstring)."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._inbox = nc.new_inbox()
        self._start = len(self._inbox) + 1
        self._seq = 0
        # token -> (deadline, future); insertion order, so the oldest entry is due first.
        self._pending: dict[str, tuple[float, asyncio.Future[bytes]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Subscribe to the reply subjects. Idempotent."""
        if self._sub is None:
            self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)

    async def close(self) -> None:
        """Fail every publish still waiting (``ConnectionClosedError``) and unsubscribe."""
        pending, self._pending = self._pending, {}
        for _, future in pending.values():
            if not future.done():
                future.set_exception(ConnectionClosedError())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # the connection goes away with it
                await sub.unsubscribe()

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str], timeout: float
    ) -> bytes:
        """Publish ``payload`` to ``subject`` and return the body of its PubAck; raise
        ``TimeoutError`` if none came within ``timeout`` seconds, ``NoRespondersError`` if
        no stream stores ``subject``, or what the client raised sending it."""
        self._seq += 1
        token = str(self._seq)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        deadline = loop.time() + timeout
        pending = self._pending
        if pending and deadline < next(reversed(pending.values()))[0]:
            # Due before a publish already waiting (a retry with less time left than a
            # first try): put in its place, so that the entries stay in deadline order.
            entries = [*pending.items(), (token, (deadline, future))]
            entries.sort(key=lambda entry: entry[1][0])
            self._pending = dict(entries)
        else:
            pending[token] = (deadline, future)
        timer = self._timer
        if timer is None or deadline < timer.when():
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(deadline, self._expire)
        try:
            await self._nc.publish(
                subject, payload, reply=f"{self._inbox}.{token}", headers=headers
            )
            return await future
        finally:
            self._pending.pop(token, None)

    async def _on_reply(self, msg: Msg) -> None:
        entry = self._pending.pop(msg.subject[self._start :], None)
        if entry is None:
            return  # answered after its deadline: its caller retried or gave up
        future = entry[1]
        if future.done():
            return
        hdrs = msg.headers
        if hdrs and hdrs.get(_STATUS) == _NO_RESPONDERS and not msg.data:
            future.set_exception(NoRespondersError())
        else:
            future.set_result(msg.data)

    def _expire(self) -> None:
        """Fail the overdue publishes with ``TimeoutError``; arm the timer for the next."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        pending = self._pending
        while pending:
            token, (deadline, future) = next(iter(pending.items()))
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire)
                return
            del pending[token]
            if not future.done():
                future.set_exception(TimeoutError())
