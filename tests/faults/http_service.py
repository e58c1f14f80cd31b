"""A small HTTP service the limit tests call, started by the test on a free loopback port.

FastAPI on uvicorn, in the test's own event loop: ``GET /call`` counts the requests in
progress (``peak`` is the most seen at once), records when each began, waits ``delay``
seconds, and answers 200, or 503 while ``failing`` is set; ``GET /hang`` never answers (a
holder that dies inside its limit). Bounded: the test stops it (``async with``).
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI, Response

__all__ = ["Service"]


class Service:
    """The service and what it saw."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self.failing = False
        self.active = 0
        self.peak = 0
        self.starts: list[float] = []
        self.ok: list[str] = []
        self.refused = 0
        self.hanging = 0
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop_hang = asyncio.Event()
        api = FastAPI()
        api.add_api_route("/call", self._call, methods=["GET"])
        api.add_api_route("/hang", self._hang, methods=["GET"])
        self.api = api

    async def _call(self, n: str, began: float | None = None) -> Response:
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.starts.append(began if began is not None else time.time())
        try:
            await asyncio.sleep(self.delay)
            if self.failing:
                self.refused += 1
                return Response(status_code=503, content="down")
            self.ok.append(n)
            return Response(status_code=200, content="ok")
        finally:
            self.active -= 1

    async def _hang(self) -> Response:
        self.active += 1
        self.hanging += 1
        try:
            await self._stop_hang.wait()
            return Response(status_code=200)
        finally:
            self.active -= 1

    def most_in_any_second(self) -> int:
        """The most requests that began within any one-second window (by the callers' clock
        where they sent it: the wall time their request began)."""
        starts = sorted(self.starts)
        best, j = 0, 0
        for i, t in enumerate(starts):
            while starts[j] <= t - 1.0:
                j += 1
            best = max(best, i - j + 1)
        return best

    def mean_rate(self) -> float:
        """Requests begun per second from the first to the last one."""
        starts = sorted(self.starts)
        if len(starts) < 2 or starts[-1] == starts[0]:
            return float("inf")
        return (len(starts) - 1) / (starts[-1] - starts[0])

    async def __aenter__(self) -> Service:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.api,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            http="h11",
            timeout_graceful_shutdown=1,
        )
        server = self._server = uvicorn.Server(config)
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop_hang.set()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._task, 10)
