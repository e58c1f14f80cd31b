"""Plain TCP connections for the network brokers' first connection, telling apart a server
that is not there (connection refused) from one that is slow or silent.

A refused connection means nothing listens on the port now: waiting the whole connect
timeout for it only delays the error, so the NATS and Kafka adapters fail their ``start``
at once on it (as PostgreSQL's driver does). On Python 3.11 ``asyncio.open_connection``
hides the refusal when a name has several addresses (``localhost``: ``::1`` and
``127.0.0.1``) that all fail, raising a plain ``OSError("Multiple exceptions: ...")``, so
:func:`open_tcp` tries the addresses itself.
"""

from __future__ import annotations

import asyncio
import socket

__all__ = ["open_tcp"]


async def open_tcp(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the first address of ``host`` that accepts; raise
    ``ConnectionRefusedError`` if every address refused, else the error of one that failed
    otherwise (unreachable, no such name). Bound it with a timeout: a host that drops the
    connection attempt is waited for."""
    loop = asyncio.get_running_loop()
    addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    refused: ConnectionRefusedError | None = None
    failed: OSError | None = None
    for family, _, _, _, address in addresses:
        try:
            return await asyncio.open_connection(str(address[0]), port, family=family)
        except ConnectionRefusedError as exc:
            refused = exc
        except OSError as exc:
            failed = exc
    if failed is not None:
        raise failed
    if refused is not None:
        raise refused
    raise OSError(f"{host!r} resolves to no address")
