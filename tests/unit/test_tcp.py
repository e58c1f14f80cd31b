"""``open_tcp``: a name whose every address refuses the connection is a refusal (the
network brokers then fail ``start`` at once), which ``asyncio.open_connection`` hides on
Python 3.11 when the name has several addresses."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from eventflow.adapters.tcp import open_tcp
from eventflow.testing.services import free_port


def _two_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every name resolve to two loopback addresses, as ``localhost`` does on a
    machine with IPv6 (``::1`` and ``127.0.0.1``)."""
    loop = asyncio.get_running_loop()

    async def resolve(host: Any, port: Any, **_: Any) -> list[Any]:
        tcp = (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "")
        return [(*tcp, ("127.0.0.1", int(port))), (*tcp, ("127.0.0.2", int(port)))]

    monkeypatch.setattr(loop, "getaddrinfo", resolve)


async def test_every_address_refusing_is_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_addresses(monkeypatch)
    port = free_port()
    with pytest.raises(ConnectionRefusedError):
        await open_tcp("two.example", port)
    with pytest.raises(OSError) as hidden:  # why open_tcp tries the addresses itself
        await asyncio.open_connection("two.example", port)
    assert not isinstance(hidden.value, ConnectionRefusedError)


async def test_the_first_address_that_accepts_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _two_addresses(monkeypatch)
    accepted: list[str] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("sockname")[0])
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.2", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _, writer = await open_tcp("two.example", port)  # 127.0.0.1 refuses, .2 accepts
        writer.close()
        await writer.wait_closed()
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.01)
        assert accepted == ["127.0.0.2"]
    finally:
        server.close()
        await server.wait_closed()
