"""A small HTTP/1.1 server and client on loopback for tests of handlers that call other
services (standard library only: ``asyncio`` streams).

The server answers each request with what ``respond(path, n)`` returns (``n``: how many
requests that path had before this one) and records every request: its path, when it
arrived (``time.monotonic()``) and how many requests were in progress with it. It refuses
requests past ``max_requests`` (500), so a test that loops ends. One request per
connection (``Connection: close``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

__all__ = ["Reply", "Request", "Server", "post", "serving"]

_MAX_HEAD = 64 * 1024


@dataclass(frozen=True)
class Reply:
    """What the server answers: a status, headers and a body."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b"{}"


@dataclass(frozen=True)
class Request:
    """One request the server received."""

    path: str
    at: float
    concurrent: int
    headers: Mapping[str, str]
    """Its headers, names in lower case."""


@dataclass
class Server:
    """The running server: its ``port`` and the ``requests`` it received, in order."""

    port: int
    respond: Callable[[str, int], Reply]
    max_requests: int
    requests: list[Request] = field(default_factory=list)
    _in_progress: int = 0
    _counts: dict[str, int] = field(default_factory=dict)

    def paths(self) -> list[str]:
        """The paths of the requests, in arrival order."""
        return [r.path for r in self.requests]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._in_progress += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > _MAX_HEAD:
                raise ValueError("request head too large")
            line, *header_lines = head.decode("latin-1").split("\r\n")
            _, path, _ = line.split(" ", 2)
            headers = _headers(header_lines)
            length = int(headers.get("content-length", "0"))
            if length:
                await reader.readexactly(length)
            self.requests.append(Request(path, time.monotonic(), self._in_progress, headers))
            n = self._counts.get(path, 0)
            self._counts[path] = n + 1
            reply = (
                self.respond(path, n)
                if len(self.requests) <= self.max_requests
                else Reply(500, body=b"too many requests for this test")
            )
            head_out = [f"HTTP/1.1 {reply.status} X", f"Content-Length: {len(reply.body)}"]
            head_out += [f"{k}: {v}" for k, v in reply.headers.items()]
            head_out.append("Connection: close")
            writer.write(("\r\n".join(head_out) + "\r\n\r\n").encode("latin-1") + reply.body)
            await writer.drain()
        finally:
            self._in_progress -= 1
            writer.close()


@asynccontextmanager
async def serving(
    respond: Callable[[str, int], Reply], *, max_requests: int = 1000
) -> AsyncIterator[Server]:
    """Run a server on 127.0.0.1 (a free port) for the ``async with`` block."""
    server = Server(0, respond, max_requests)
    listener = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    try:
        yield server
    finally:
        listener.close()
        await listener.wait_closed()


def _headers(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for header in lines:
        name, _, value = header.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return headers


async def post(
    port: int, path: str, body: bytes = b"{}", *, headers: Mapping[str, str] | None = None
) -> tuple[int, dict[str, str]]:
    """POST ``body`` to ``path`` on the loopback server with ``headers``; return the status
    and the reply's headers (names in lower case)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n".encode("latin-1")
            + body
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        line, *header_lines = head.decode("latin-1").split("\r\n")
        reply = _headers(header_lines)
        await reader.readexactly(int(reply.get("content-length", "0")))
        return int(line.split(" ")[1]), reply
    finally:
        writer.close()
        await writer.wait_closed()
