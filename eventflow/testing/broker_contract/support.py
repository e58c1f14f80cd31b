"""What the broker contract's modules share: the ``broker_factory`` type and
:func:`broker_pool`, the waits (:func:`eventually`, :func:`collect`, :func:`drain`), the
:class:`Member` helper and the base class holding the timing attributes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

from ...ports import Broker, Delivery, Subscription
from ..waiting import eventually as _eventually

__all__ = [
    "BrokerContractBase",
    "BrokerFactory",
    "Member",
    "SilentServer",
    "broker_pool",
    "collect",
    "drain",
    "eventually",
    "unique_name",
]

BrokerFactory = Callable[[], Awaitable[Broker]]
"""Returns a new started broker on the shared backend; the fixture closes it after the test."""

DEFAULT_TIMEOUT = 10.0
DEFAULT_QUIET_PERIOD = 0.5
_POLL_INTERVAL = 0.02
_FETCH_WAIT = 0.5


def unique_name(prefix: str = "ct") -> str:
    """A fresh name usable as a topic token, group or hub name on every broker."""
    return f"{prefix}{uuid.uuid4().hex[:16]}"


async def eventually(
    condition: Callable[[], object],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = _POLL_INTERVAL,
    message: str = "condition",
) -> object:
    """:func:`eventflow.testing.waiting.eventually` with the contracts' defaults (10 s: a
    network broker on a loaded machine); fails with the condition's last value."""
    return await _eventually(condition, timeout, interval=interval, message=message)


async def collect(
    sub: Subscription,
    count: int,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    ack: bool = True,
    max_messages: int = 10,
) -> list[Delivery]:
    """Fetch exactly ``count`` deliveries (acking each if ``ack``); fail after ``timeout``.

    Never asks for more than are still missing, so nothing extra is left in flight.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    out: list[Delivery] = []
    while len(out) < count:
        remaining = deadline - loop.time()
        if remaining <= 0:
            got = [(d.topic, d.payload, d.key) for d in out]
            raise AssertionError(f"expected {count} deliveries within {timeout}s, got {got}")
        batch = await sub.fetch(min(max_messages, count - len(out)), min(remaining, _FETCH_WAIT))
        for delivery in batch:
            out.append(delivery)
            if ack:
                await delivery.ack()
    return out


async def drain(sub: Subscription, duration: float, *, ack: bool = True) -> list[Delivery]:
    """Fetch for ``duration`` seconds and return everything that arrived (acked if ``ack``).

    Used to check that something does not happen: an empty result means nothing came.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + duration
    out: list[Delivery] = []
    while (remaining := deadline - loop.time()) > 0:
        batch = await sub.fetch(10, min(remaining, _FETCH_WAIT))
        for delivery in batch:
            out.append(delivery)
            if ack:
                await delivery.ack()
    return out


@asynccontextmanager
async def broker_pool(make: Callable[[], Broker]) -> AsyncIterator[BrokerFactory]:
    """Yield a :data:`BrokerFactory` that starts brokers built by ``make``; close them at exit."""
    brokers: list[Broker] = []

    async def factory() -> Broker:
        broker = make()
        await broker.start()
        brokers.append(broker)
        return broker

    try:
        yield factory
    finally:
        for broker in reversed(brokers):
            await broker.close()


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts connections and never says a word, as a port
    of another protocol (or a stuck proxy) does to a client waiting to be greeted. It keeps
    the connections, so a test can check that a client that gave up closed them::

        async with SilentServer() as silent:
            broker = NatsBroker.from_url(f"nats://127.0.0.1:{silent.port}?connect_timeout=1")
            ...
            assert await silent.all_closed()
    """

    def __init__(self) -> None:
        self.port = 0
        self.connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> SilentServer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        for _, writer in self.connections:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.append((reader, writer))

    async def all_closed(self, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """True once the client closed every connection it made (reads reach end of file)
        within ``timeout`` seconds; False if one stays open."""
        try:
            async with asyncio.timeout(timeout):
                for reader, _ in self.connections:
                    while await reader.read(65536):
                        pass  # what the client sent while it waited for an answer
        except TimeoutError:
            return False
        return True


class Member:
    """A group member that fetches and acks in the background, recording what it got.

    ``log`` may be shared between members to see the order in which the group received
    messages. Run :meth:`run` as a task and cancel it to stop.
    """

    def __init__(
        self, name: str, sub: Subscription, log: list[tuple[str, Delivery]] | None = None
    ) -> None:
        self.name = name
        self.sub = sub
        self.received: list[Delivery] = []
        self.log = log if log is not None else []

    async def run(self) -> None:
        """Fetch, record and ack until cancelled."""
        while True:
            for delivery in await self.sub.fetch(10, _FETCH_WAIT):
                self.received.append(delivery)
                self.log.append((self.name, delivery))
                await delivery.ack()


async def _run_members(
    members: Sequence[Member], done: Callable[[], bool], *, timeout: float, quiet: float
) -> None:
    """Run ``members`` until ``done()``, then ``quiet`` seconds more (to catch extras)."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(m.run()) for m in members]
        try:
            await eventually(done, timeout=timeout, message="members received everything")
            await asyncio.sleep(quiet)  # a window for duplicates to show up, not a sync point
        finally:
            for task in tasks:
                task.cancel()


def _texts(deliveries: Sequence[Delivery]) -> list[str]:
    return [d.payload.decode() for d in deliveries]


class BrokerContractBase:
    """What every part of :class:`~eventflow.testing.broker_contract.BrokerContract` uses:
    the timing attributes (the adapter's test module provides ``broker_factory``)."""

    timeout: float = DEFAULT_TIMEOUT
    """Seconds to wait for something that must happen."""
    quiet_period: float = DEFAULT_QUIET_PERIOD
    """Seconds to watch for something that must not happen (an extra delivery)."""
    nack_delay: float = 1.0
    """The delay used in the ``nack(delay)`` tests."""
    max_message_bytes: int = 1024 * 1024
    """The largest payload the brokers of ``broker_factory`` accept (1 MiB, the default of
    every adapter; a module may configure its brokers with a smaller limit and say so)."""
