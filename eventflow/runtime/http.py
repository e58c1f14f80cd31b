"""The app's small HTTP port: ``/healthz``, ``/readyz`` and ``/metrics`` (DESIGN 8).

Three GET endpoints do not need a web framework: this is ``asyncio.start_server`` with a
request line, headers skipped, one answer and ``Connection: close``. The app binds the
port in ``start`` (a port in use fails the start, naming it) before its subscriptions
join, so ``/readyz`` answers "not ready" while they do, and runs it as a component of its
supervisor; closing the server cancels the requests still being answered.

- ``/healthz``: 200 whenever the event loop answers (nothing else is checked).
- ``/readyz``: 200 with ``{"status": "ok"}`` when the app has started (every subscription
  live) and every component runs well (``App.health()``: broker and store reachable, none
  failed or being restarted); else 503 with the status and a line per problem.
- ``/metrics``: the Prometheus text format, or 503 saying which extra to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from ..errors import ConfigurationError

__all__ = ["REQUEST_TIMEOUT", "HttpServer", "Response"]

REQUEST_TIMEOUT = 10.0
"""Seconds one request may take to arrive and be answered before its connection closes."""
_MAX_HEADER_LINES = 100
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_log = logging.getLogger("eventflow.http")


@dataclass(frozen=True, slots=True)
class Response:
    """One answer: status code, body and content type."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[], Awaitable[Response]]


class HttpServer:
    """Serves GET ``routes`` (path -> coroutine function) on ``host:port`` (0: any free)."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Route], *, name: str) -> None:
        self.host = host
        self.port = port
        self.routes = routes
        self.name = name
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[object]] = set()

    @property
    def address(self) -> tuple[str, int] | None:
        """The (host, port) it listens on, once open."""
        server = self._server
        if server is None or not server.sockets:
            return None
        host, port = server.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def open(self) -> None:
        """Bind and start accepting. Raises ``ConfigurationError`` when the port cannot be
        bound (in use, not allowed). Idempotent."""
        if self._server is not None:
            return
        try:
            self._server = await asyncio.start_server(self._client, self.host, self.port)
        except OSError as exc:
            raise ConfigurationError(
                f"{self.name}: cannot listen on {self.host}:{self.port} ({exc}); pick "
                "another http_port (--port), or 0 for any free one"
            ) from exc
        _log.info("%s: serving /healthz /readyz /metrics on %s", self.name, self.address)

    async def serve(self) -> None:
        """Answer requests until cancelled (the app's supervisor runs it); then close."""
        await self.open()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop accepting, cancel the requests being answered, wait for them. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        clients = list(self._clients)
        for task in clients:
            task.cancel()
        if clients:
            await asyncio.wait(clients)
        if server is not None:
            await server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                response, head_only = await self._answer(reader)
                head = (
                    f"HTTP/1.1 {response.status} {_REASONS.get(response.status, '')}\r\n"
                    f"Content-Type: {response.content_type}\r\n"
                    f"Content-Length: {len(response.body)}\r\n"
                    "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
                ).encode("latin-1")
                writer.write(head if head_only else head + response.body)
                await writer.drain()
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away or was too slow: nothing to answer
        except Exception:
            _log.exception("%s: answering a request failed", self.name)
        finally:
            self._clients.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[Response, bool]:
        line = await reader.readline()
        for _ in range(_MAX_HEADER_LINES):  # headers: nothing here needs them
            if (await reader.readline()).strip() == b"":
                break
        parts = line.decode("latin-1").split()
        if len(parts) != 3:
            return Response(405, b"send a GET request\n"), False
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD are served\n"), False
        route = self.routes.get(target)
        if route is None:
            known = " ".join(sorted(self.routes))
            return Response(404, f"no {target} here; try {known}\n".encode()), method == "HEAD"
        return await route(), method == "HEAD"
