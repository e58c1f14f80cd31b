"""The Kafka broker's first connection: bounded by ``connect_timeout`` and interruptible.

aiokafka waits up to its request timeout (40 s by default) for each bootstrap server, and a
cancellation that lands while it waits for the first metadata answer leaves that connection
(a socket and its reader task) open. So before any aiokafka client starts, :func:`probe`
asks the bootstrap servers itself, with a plain socket it always closes: one ApiVersions
request (version 0, which every Kafka-protocol broker answers), retried until one server
answers or ``connect_timeout`` ends. It tells apart a server that is down (refused), one
that accepts and stays silent, and one that answers in another protocol (a NATS port sends
its ``INFO`` line first), and names the URL and what to check. When every server refuses
the connection (nothing listens there) it fails at once, as waiting cannot help. Once a
server has answered, the clients' own bootstraps take milliseconds.

Closing is as careful: :func:`close_client` closes a client whose start failed (it may never
have connected), and :func:`stop_consumer` stops a consumer also when its brokers are away.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from ...errors import BrokerError
from ..tcp import open_tcp

__all__ = ["close_client", "probe", "stop_consumer"]

_log = logging.getLogger("eventflow.kafka")

_API_VERSIONS = 18
_RETRY = 0.25
_MIN_ATTEMPT = 0.5
_correlation = itertools.count(1)


class _NotKafka(Exception):
    """The server answered, but not as a Kafka broker."""


class _Silent(Exception):
    """The server accepted the connection and did not answer."""


async def probe(servers: tuple[str, ...], client_id: str, url: str, timeout: float) -> None:
    """Return once one of ``servers`` (``host:port``) answers a Kafka request; raise
    ``BrokerError`` naming ``url`` and what to check after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    errors: dict[str, BaseException] = {}
    while True:
        for server in servers:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise BrokerError(_failure(url, timeout, errors))
            attempt = min(remaining, max(_MIN_ATTEMPT, remaining / len(servers)))
            try:
                await _ask(server, client_id, attempt)
                return
            except (OSError, TimeoutError, _NotKafka, _Silent) as exc:
                errors[server] = exc
        if all(isinstance(errors.get(s), ConnectionRefusedError) for s in servers):
            raise BrokerError(_refused(url, errors))
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise BrokerError(_failure(url, timeout, errors))
        await asyncio.sleep(min(_RETRY, remaining))


async def _ask(server: str, client_id: str, timeout: float) -> None:
    host, _, port = server.rpartition(":")
    async with asyncio.timeout(timeout):
        reader, writer = await open_tcp(host.strip("[]"), int(port))
    try:
        correlation = next(_correlation) & 0x7FFFFFFF
        name = client_id.encode()
        body = struct.pack(">hhih", _API_VERSIONS, 0, correlation, len(name)) + name
        writer.write(struct.pack(">i", len(body)) + body)
        try:
            async with asyncio.timeout(timeout):
                await writer.drain()
                head = await reader.readexactly(8)
        except TimeoutError:
            raise _Silent() from None
        except asyncio.IncompleteReadError as exc:
            raise _NotKafka(f"it closed the connection after {len(exc.partial)} bytes") from None
        size, answered = struct.unpack(">ii", head)
        if answered != correlation or not 4 <= size < 1 << 24:
            raise _NotKafka(f"it answered {head!r}")
    finally:
        writer.close()


def _refused(url: str, errors: dict[str, BaseException]) -> str:
    detail = "; ".join(f"{server}: {exc}" for server, exc in errors.items())
    return (
        f"kafka: cannot connect to {url}: every bootstrap server refused the connection "
        f"({detail}), so nothing listens there; check that the brokers are running and that "
        "the URL names their Kafka listener (9092 by default)"
    )


def _failure(url: str, timeout: float, errors: dict[str, BaseException]) -> str:
    lines = []
    for server, exc in errors.items():
        if isinstance(exc, _Silent):
            why = (
                "accepted the connection but did not answer a Kafka request: is this a Kafka "
                "broker's port (9092 by default), not a port of another protocol?"
            )
        elif isinstance(exc, _NotKafka):
            why = (
                f"answered, but not as a Kafka broker ({exc}): the port belongs to another "
                "protocol (a NATS port answers with INFO); use the broker's Kafka listener"
            )
        elif isinstance(exc, TimeoutError):
            why = "did not accept a connection in time: is the host reachable from here?"
        else:
            why = f"{type(exc).__name__}: {exc}: is the broker running there?"
        lines.append(f"{server} {why}")
    detail = "; ".join(lines) if lines else "no server was tried"
    return (
        f"kafka: cannot connect to {url} within connect_timeout={timeout:g}s: {detail}; "
        "check that the brokers are running and reachable, and raise connect_timeout= on a "
        "slow network"
    )


async def close_client(client: AIOKafkaAdminClient | AIOKafkaProducer | AIOKafkaConsumer) -> None:
    """Close a client whose start failed or was cancelled (it may never have connected)."""
    try:
        if isinstance(client, AIOKafkaAdminClient):
            await client.close()
        else:
            await client.stop()
    except Exception as exc:
        _log.debug("kafka: closing a client after a failed start: %s", exc)


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """Stop an aiokafka consumer, also when its brokers are unreachable.

    Then aiokafka's fetcher cancels its pending fetch requests and awaits them without
    catching their cancellation: ``stop`` raises ``CancelledError`` (although nobody
    cancelled the caller) before closing the client, whose metadata task would be left
    running. That cancellation is not the caller's, so it ends here, and the client is
    closed; the caller's own cancellation still goes through."""
    task = asyncio.current_task()
    asked = task.cancelling() if task is not None else 0
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        if task is None or task.cancelling() > asked:
            raise
        _log.debug("kafka: a consumer's stop was cut short by its own fetcher; closing it")
        await consumer._client.close()
