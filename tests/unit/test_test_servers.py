"""The test servers (``NatsServer``, ``KafkaServer``) start on ports of their own.

A server is given a :func:`free_port`, which another process may take before the server binds
it: another test server (which then answered the readiness check in this one's place, so a
test paused or killed a server its clients were not talking to), or any process's
connection (the server failed to bind and exited). Both starts move to another port.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import nats
import pytest

from eventflow.adapters.kafka.connection import probe
from eventflow.testing.kafka_server import KafkaServer
from eventflow.testing.nats_server import NatsServer
from eventflow.testing.services import holds_listener


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another listener holds (it accepts and says nothing)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_holds_listener_tells_whose_the_listener_is(taken: int) -> None:
    code = (
        "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
        "print(s.getsockname()[1], flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            theirs = int(child.stdout.readline())
            assert holds_listener(os.getpid(), taken) is True
            assert holds_listener(child.pid, taken) is False
            assert holds_listener(os.getpid(), theirs) is False
            assert holds_listener(child.pid, theirs) is True
        finally:
            child.kill()


def test_a_kafka_server_whose_port_another_listener_holds_starts_on_another(taken: int) -> None:
    server = KafkaServer()
    server.port = taken
    with server:
        assert server.port != taken
        asyncio.run(probe((server.bootstrap,), "t", server.url, 10.0))  # a Kafka answer


def test_a_nats_server_whose_port_another_listener_holds_starts_on_another(taken: int) -> None:
    server = NatsServer()
    server.port = taken
    with server:
        assert server.port != taken

        async def jetstream() -> None:
            nc = await nats.connect(server.url)
            try:
                await nc.jetstream().account_info()
            finally:
                await nc.close()

        asyncio.run(jetstream())


def test_a_nats_server_whose_monitor_port_another_server_answers_starts_on_another() -> None:
    with NatsServer() as other:
        server = NatsServer()
        server.monitor_port = other.monitor_port  # the other's health check says ok
        with server:
            assert server.monitor_port != other.monitor_port
            assert holds_listener(server._proc.pid, server.port) is True  # type: ignore[union-attr]


def test_a_restarted_nats_server_keeps_its_port() -> None:
    with NatsServer() as server:
        port = server.port
        server.restart()
        assert server.port == port
        assert holds_listener(server._proc.pid, port) is True  # type: ignore[union-attr]
