"""The start-up contract of a network broker: the first connection is bounded by the
adapter's ``connect_timeout`` and fails with a ``BrokerError`` naming where it tried (at
once when nothing listens there), and a start that is cancelled (SIGINT during start-up)
ends at once, leaving nothing open.

An adapter's test module subclasses :class:`StartupContract` and provides ``broker_at``: a
function building an unstarted broker for ``127.0.0.1:PORT`` with a given connect timeout.
The memory broker has no connection, so it has no such module.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from ...errors import BrokerError
from ...ports import Broker
from ..services import free_port
from .support import SilentServer, eventually

__all__ = ["BrokerAt", "StartupContract", "refused_start"]

BrokerAt = Callable[[int, float], Broker]
"""``broker_at(port, connect_timeout)``: an unstarted broker for ``127.0.0.1:port``."""


async def refused_start(broker: Broker, within: float) -> BrokerError:
    """Start ``broker``, expecting a ``BrokerError`` within ``within`` seconds; close it."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    try:
        with pytest.raises(BrokerError) as info:
            await asyncio.wait_for(broker.start(), within + 10)
    finally:
        await broker.close()
    took = loop.time() - began
    assert took < within, f"start gave up after {took:.1f}s, not within {within}s"
    return info.value


class StartupContract:
    """A network broker's first connection: bounded, interruptible, telling what to check."""

    async def test_start_without_a_server_fails_within_connect_timeout(
        self, broker_at: BrokerAt
    ) -> None:
        """Nothing listens: ``start`` gives up after ``connect_timeout`` (not retrying for
        ever) with a ``BrokerError`` that names the address and asks whether it runs."""
        port = free_port()
        error = await refused_start(broker_at(port, 1.0), within=4)
        assert f"127.0.0.1:{port}" in str(error)
        assert "running" in str(error)

    async def test_a_refused_connection_fails_at_once_naming_the_url(
        self, broker_at: BrokerAt
    ) -> None:
        """Nothing listens on the port (the connection is refused): waiting cannot help, so
        ``start`` fails at once, long before a 10 s ``connect_timeout`` (as PostgreSQL's
        does), with a ``BrokerError`` naming the address and what to check."""
        port = free_port()
        error = await refused_start(broker_at(port, 10.0), within=2)
        assert f"127.0.0.1:{port}" in str(error)
        assert "refused" in str(error) and "running" in str(error)

    async def test_start_on_a_port_that_never_answers_fails_and_closes_its_socket(
        self, broker_at: BrokerAt
    ) -> None:
        """A port that accepts and stays silent (another protocol's): a ``BrokerError``
        naming the address, and the client closes its connection. (A connect timeout of 3 s:
        on a loaded machine a client given 1 s was seen to give up before it even connected,
        which tests nothing here.)"""
        async with SilentServer() as silent:
            error = await refused_start(broker_at(silent.port, 3.0), within=8)
            assert f"127.0.0.1:{silent.port}" in str(error)
            # The server takes a connection the client made from its backlog on a later turn
            # of the loop, maybe after the client gave up.
            await eventually(lambda: silent.connections, message="the client connected")
            assert await silent.all_closed(timeout=2), "a socket was left open"

    async def test_cancelling_start_stops_it_at_once_and_leaves_nothing_open(
        self, broker_at: BrokerAt
    ) -> None:
        """SIGINT during start-up cancels ``start``: it ends at once, its socket is closed
        and no client task is left (the contract modules' fixture checks the tasks)."""
        async with SilentServer() as silent:
            broker = broker_at(silent.port, 60.0)
            starting = asyncio.create_task(broker.start())
            await eventually(lambda: silent.connections, message="the client connected")
            loop = asyncio.get_running_loop()
            began = loop.time()
            starting.cancel()
            await asyncio.wait({starting}, timeout=5)
            assert starting.cancelled()
            assert loop.time() - began < 1.0
            assert await silent.all_closed(timeout=2), "a socket was left open"
            await broker.close()
