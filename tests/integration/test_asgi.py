"""``eventflow.asgi``: an ``App`` run by a FastAPI app's lifespan, on memory and on NATS.

The ASGI lifespan protocol is driven as a server drives it (``lifespan.startup``, then
``lifespan.shutdown``), requests go through ``httpx.ASGITransport``; the uvicorn run of
``docs/fastapi.md`` is in ``tests/integration/test_asgi_docs.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, Request, Response
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse
from starlette.routing import Route

from eventflow import (
    App,
    BrokerError,
    ComponentFailedError,
    ConfigurationError,
    Context,
    Event,
    RequestTimeoutError,
    subscribe,
)
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.asgi import current_app, lifespan, readyz
from eventflow.ports import Delivery, Subscription
from eventflow.testing.nats_server import nats_service_url
from eventflow.testing.services import free_port, stop_process

Events = Annotated[App, Depends(current_app)]
"""The running App, as an endpoint's parameter (how docs/fastapi.md declares it)."""


class OrderPlaced(Event, type="asgitest.order.placed"):
    order_id: str


class ReserveStock(Event, type="asgitest.stock.reserve"):
    order_id: str


class StockReserved(Event, type="asgitest.stock.reserved"):
    order_id: str


class StockRejected(Event, type="asgitest.stock.rejected"):
    order_id: str


class Lifespan:
    """Drives an ASGI app's lifespan as a server does, one message each way at a time."""

    def __init__(self, asgi: Any) -> None:
        self._asgi = asgi
        self._to_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1)
        self._from_app: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=1)
        self._task: asyncio.Task[None] | None = None
        self.state: dict[str, Any] = {}  # the lifespan state, as a server keeps it
        self.error: BaseException | None = None

    async def startup(self) -> str:
        """Send ``lifespan.startup``; return the app's answer's type."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": self.state}
        self._task = asyncio.create_task(self._asgi(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        return str((await self._from_app.get())["type"])

    async def ended(self) -> None:
        """Wait for the lifespan to end by itself (after a failed start-up: it re-raises)."""
        assert self._task is not None
        await self._task

    async def shutdown(self) -> dict[str, Any]:
        """Send ``lifespan.shutdown``; return the app's answer once its lifespan ended (what
        it raised, as a server would log it, in ``error``)."""
        await self._to_app.put({"type": "lifespan.shutdown"})
        answer = await self._from_app.get()
        assert self._task is not None
        await asyncio.wait({self._task})
        self.error = self._task.exception()
        return answer


@contextlib.asynccontextmanager
async def served(asgi: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """The ASGI app started (its lifespan complete) and a client on it; shut down after."""
    life = Lifespan(asgi)
    assert await life.startup() == "lifespan.startup.complete"
    try:
        transport = httpx.ASGITransport(app=asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            yield client
    finally:
        answer = await life.shutdown()
        assert answer["type"] == "lifespan.shutdown.complete", answer


@dataclass
class Seen:
    """What the handlers of one test's App saw."""

    orders: list[str] = field(default_factory=list)
    hold: asyncio.Event | None = None
    finished: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)


def orders_service(broker: Any, seen: Seen, group: str, **kwargs: Any) -> tuple[App, FastAPI]:
    """An App whose handler records placed orders, and a FastAPI app publishing them."""

    @subscribe(OrderPlaced.event_type, group=group, concurrency=4)
    async def record(event: OrderPlaced, ctx: Context) -> None:
        seen.orders.append(event.order_id)
        if seen.hold is not None:
            try:
                await seen.hold.wait()
            except asyncio.CancelledError:
                seen.cancelled.append(event.order_id)
                raise
        seen.finished.append(event.order_id)

    events = App("orders", broker=broker, handlers=[record], **kwargs)
    http = FastAPI(lifespan=lifespan(events))
    http.add_api_route("/readyz", readyz)

    @http.post("/orders/{order_id}", status_code=202)
    async def place(order_id: str, app: Events) -> dict[str, str]:
        env = await app.publish(OrderPlaced(order_id=order_id), key=order_id)
        return {"order_id": order_id, "message_id": env.id}

    return events, http


@pytest.fixture(scope="module")
def asgi_nats_url() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("nats", id="nats", marks=pytest.mark.service("nats")),
    ]
)
def broker(request: pytest.FixtureRequest, broker_url: str, hub: MemoryBroker) -> str:
    """The test's broker URL: a memory hub, or a NATS stream of its own."""
    if request.param == "memory":
        return broker_url
    nats = request.getfixturevalue("asgi_nats_url")
    return f"{nats}?stream=EFASGI{uuid.uuid4().hex[:10]}&storage=memory"


async def test_a_post_publishes_and_a_handler_of_the_same_app_sees_it(
    broker: str, waiter: Any
) -> None:
    seen = Seen()
    events, http = orders_service(broker, seen, "record")
    async with served(http) as client:
        answer = await client.post("/orders/o-1")
        assert answer.status_code == 202
        assert answer.json()["order_id"] == "o-1"
        await waiter(lambda: seen.orders == ["o-1"], what="the handler got the order")
        ready = await client.get("/readyz")
        assert (ready.status_code, ready.json()["status"]) == (200, "ok")
    assert events.health().status == "stopped"  # the lifespan's shutdown stopped it


async def test_subscriptions_are_live_when_start_up_completes(broker: str, waiter: Any) -> None:
    """A message another service publishes right after start-up (before any request)
    reaches the handler: the group joined before the server was told it may serve (a
    group joining later would begin after it: ``start="latest"``)."""
    seen = Seen()
    events, http = orders_service(broker, seen, "record")
    life = Lifespan(http)
    assert await life.startup() == "lifespan.startup.complete"
    try:
        assert events.readiness()[0]
        async with App("upstream", broker=broker) as upstream:
            await upstream.publish(OrderPlaced(order_id="o-first"), key="o-first")
        await waiter(lambda: seen.orders == ["o-first"], what="the first message handled")
    finally:
        assert (await life.shutdown())["type"] == "lifespan.shutdown.complete"


async def test_shutdown_drains_a_handler_in_flight(broker: str, waiter: Any) -> None:
    seen = Seen(hold=asyncio.Event())
    events, http = orders_service(broker, seen, "record", grace_period=30.0)
    life = Lifespan(http)
    assert await life.startup() == "lifespan.startup.complete"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=http), base_url="http://shop"
    ) as client:
        assert (await client.post("/orders/o-slow")).status_code == 202
    await waiter(lambda: seen.orders == ["o-slow"], what="the handler in flight")
    shutting_down = asyncio.create_task(life.shutdown())
    await waiter(lambda: events.health().status == "stopped", what="the app stopping")
    assert not shutting_down.done()  # it waits for the handler, not cancelling it
    assert seen.hold is not None
    seen.hold.set()
    answer = await shutting_down
    assert answer["type"] == "lifespan.shutdown.complete"
    assert (seen.finished, seen.cancelled) == (["o-slow"], [])


async def test_the_user_s_lifespan_runs_inside_the_app_s(broker_url: str, hub: Any) -> None:
    """The inner lifespan may publish at start-up and ends before the app stops; its state
    reaches the requests."""
    events = App("orders", broker=broker_url)
    steps: list[str] = []

    @contextlib.asynccontextmanager
    async def mine(asgi: FastAPI) -> AsyncIterator[dict[str, str]]:
        await events.publish(OrderPlaced(order_id="o-warmup"))  # the app runs already
        steps.append("mine started")
        yield {"greeting": "hello"}
        assert events.readiness()[0]  # still running while the user's lifespan ends
        steps.append("mine ended")

    http = FastAPI(lifespan=lifespan(events, inner=mine))

    @http.get("/greeting")
    async def greeting(request: Request) -> str:
        return str(request.state.greeting)

    life = Lifespan(http)
    assert await life.startup() == "lifespan.startup.complete"
    assert steps == ["mine started"]
    # ASGITransport passes no lifespan state; a server does: the scope's copy of it.
    scope_state = {"greeting": "hello"}
    assert life.state == scope_state
    assert (await life.shutdown())["type"] == "lifespan.shutdown.complete"
    assert steps == ["mine started", "mine ended"]
    assert events.health().status == "stopped"


async def test_a_start_that_fails_fails_the_server_s_start_up() -> None:
    # Nothing listens on port 1: the broker's first connection fails within its timeout.
    events = App("orders", broker="nats://127.0.0.1:1?connect_timeout=0.5")
    http = FastAPI(lifespan=lifespan(events))
    life = Lifespan(http)
    assert await life.startup() == "lifespan.startup.failed"
    with pytest.raises(BrokerError, match=r"127\.0\.0\.1:1"):
        await life.ended()
    assert events.health().status == "stopped"


class _Breakable:
    """A real memory subscription whose fetch fails like an adapter bug once broken."""

    def __init__(self, broker: BreakableBroker, inner: Subscription) -> None:
        self._broker, self._inner = broker, inner
        self.pattern, self.group = inner.pattern, inner.group

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[Delivery]:
        if self._broker.broken:
            raise RuntimeError("adapter bug")  # not transient: the consumer is not restarted
        return await self._inner.fetch(max_messages, timeout)

    async def close(self) -> None:
        await self._inner.close()


class BreakableBroker(MemoryBroker):
    """A memory broker whose subscriptions break when told (``broken = True``)."""

    broken = False

    async def subscribe(self, pattern: str, **kwargs: Any) -> Any:
        return _Breakable(self, await super().subscribe(pattern, **kwargs))


async def test_a_failed_component_makes_readyz_answer_503(broker_name: str, waiter: Any) -> None:
    """A component that fails for good: ``/readyz`` says so, and the lifespan's shutdown
    fails with the failure (the server logs it)."""
    broker = BreakableBroker(MemoryBrokerConfig(name=broker_name))
    events, http = orders_service(broker, Seen(), "record")
    life = Lifespan(http)
    assert await life.startup() == "lifespan.startup.complete"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=http), base_url="http://shop"
    ) as client:
        assert (await client.get("/readyz")).status_code == 200
        broker.broken = True
        await waiter(lambda: events.failure is not None, what="the component failure")
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["status"] == "failed"
    answer = await life.shutdown()
    assert answer["type"] == "lifespan.shutdown.failed"
    assert isinstance(life.error, ComponentFailedError)
    assert life.error is events.failure
    assert "adapter bug" in answer["message"]


async def test_on_failure_hears_of_a_failure_when_it_happens(broker_name: str, waiter: Any) -> None:
    broker = BreakableBroker(MemoryBrokerConfig(name=broker_name))
    events, _ = orders_service(broker, Seen(), "record")
    with pytest.raises(ConfigurationError, match="not running"):
        await events.wait_failed()
    heard: list[ComponentFailedError] = []
    http = FastAPI(lifespan=lifespan(events, on_failure=heard.append))
    life = Lifespan(http)
    assert await life.startup() == "lifespan.startup.complete"
    assert heard == []
    broker.broken = True
    await waiter(lambda: heard != [], what="on_failure called")
    assert heard == [events.failure]
    assert (await life.shutdown())["type"] == "lifespan.shutdown.failed"


def test_terminate_stops_uvicorn_when_a_component_fails(tmp_path: Path) -> None:
    """``on_failure=terminate``: the server stops by itself (SIGTERM to its own process),
    shutting down as on ``kill``, and logs the failure."""
    (tmp_path / "failing_http.py").write_text(FAILING_SERVICE)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "failing_http:http", "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            time.sleep(0.05)
        assert httpx.post(f"{base}/break").status_code == 204
        out, _ = proc.communicate(timeout=30)  # it ends by itself
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    assert "RuntimeError: adapter bug" in out
    assert "stopping the server (SIGTERM) so that it is restarted" in out
    assert "Application shutdown failed" in out
    assert proc.returncode != 0


FAILING_SERVICE = """
from typing import Any

from fastapi import FastAPI, Response

from eventflow import App, Event, subscribe
from eventflow.adapters.memory import MemoryBroker


class Tick(Event, type="asgitest.tick"):
    n: int


class Broken:
    def __init__(self, broker: Any, inner: Any) -> None:
        self._broker, self._inner = broker, inner
        self.pattern, self.group = inner.pattern, inner.group

    async def fetch(self, max_messages: int, timeout: float) -> Any:
        if self._broker.broken:
            raise RuntimeError("adapter bug")
        return await self._inner.fetch(max_messages, timeout)

    async def close(self) -> None:
        await self._inner.close()


class BreakableBroker(MemoryBroker):
    broken = False

    async def subscribe(self, pattern: str, **kwargs: Any) -> Any:
        return Broken(self, await super().subscribe(pattern, **kwargs))


@subscribe("asgitest.tick", group="g")
async def tick(event: Tick) -> None: ...


broker = BreakableBroker()
events = App("failing", broker=broker, handlers=[tick])
http = FastAPI(lifespan=lifespan(events, on_failure=terminate))
http.add_api_route("/readyz", readyz)


@http.post("/break", status_code=204)
async def breaks() -> Response:
    broker.broken = True
    return Response(status_code=204)
""".replace(
    "from eventflow import",
    "from eventflow.asgi import lifespan, readyz, terminate\nfrom eventflow import",
)


async def test_a_starlette_app_without_fastapi(broker_url: str, hub: Any, waiter: Any) -> None:
    """The lifespan, ``current_app`` and ``readyz`` need only Starlette."""
    seen = Seen()
    events, _ = orders_service(broker_url, seen, "record")

    async def place(request: StarletteRequest) -> JSONResponse:
        order_id = request.path_params["order_id"]
        await current_app(request).publish(OrderPlaced(order_id=order_id), key=order_id)
        return JSONResponse({"order_id": order_id}, status_code=202)

    routes = [Route("/readyz", readyz), Route("/orders/{order_id}", place, methods=["POST"])]
    web = Starlette(lifespan=lifespan(events), routes=routes)
    async with served(web) as client:
        assert (await client.get("/readyz")).json()["status"] == "ok"
        assert (await client.post("/orders/o-7")).status_code == 202
        await waiter(lambda: seen.orders == ["o-7"], what="the handler got the order")


async def test_a_test_can_override_the_dependency(broker_url: str, hub: Any, waiter: Any) -> None:
    """``dependency_overrides[current_app]``: the endpoint publishes through another app."""
    seen = Seen()
    replacement, _ = orders_service(broker_url, seen, "record")
    _, http = orders_service("memory://never-started", Seen(), "record")
    http.dependency_overrides[current_app] = lambda: replacement
    transport = httpx.ASGITransport(app=http)
    async with replacement, httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.post("/orders/o-9")).status_code == 202
        await waiter(lambda: seen.orders == ["o-9"], what="the replacement's handler")


def test_current_app_outside_a_lifespan_says_what_to_do() -> None:
    http = FastAPI()

    @http.get("/")
    async def root(app: Events) -> str:
        return app.name

    transport = httpx.ASGITransport(app=http, raise_app_exceptions=True)

    async def call() -> None:
        async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
            await client.get("/")

    with pytest.raises(ConfigurationError, match=r"lifespan=eventflow\.asgi\.lifespan\(app\)"):
        asyncio.run(call())


# -- request-reply from an endpoint: answer when the reply comes in time, else 202 ----------


def stock_service(broker: str, group: str, silent: set[str]) -> App:
    """The participant: reserves stock, except for the orders in ``silent`` (no answer)."""

    @subscribe(ReserveStock.event_type, group=group)
    async def reserve(cmd: ReserveStock, ctx: Context) -> None:
        if cmd.order_id not in silent:
            await ctx.publish(StockReserved(order_id=cmd.order_id))

    return App("inventory", broker=broker, handlers=[reserve])


def waiting_orders(broker: str) -> FastAPI:
    """``POST /orders/{id}?wait=S``: the outcome if it comes within S seconds, else 202."""
    events = App("orders", broker=broker)
    http = FastAPI(lifespan=lifespan(events))

    @http.post("/orders/{order_id}")
    async def place(
        order_id: str, response: Response, app: Events, wait: float = 5.0
    ) -> dict[str, str]:
        try:
            reply = await app.request(
                ReserveStock(order_id=order_id),
                expect=StockReserved | StockRejected,
                timeout=wait,
                key=order_id,
            )
        except RequestTimeoutError:
            response.status_code = 202
            response.headers["Location"] = f"/orders/{order_id}"
            return {"order_id": order_id, "status": "pending"}
        response.status_code = 200 if isinstance(reply, StockReserved) else 409
        return {"order_id": order_id, "status": type(reply).event_type}

    return http


async def test_an_endpoint_waits_for_a_reply_or_answers_202(broker: str) -> None:
    stock = stock_service(broker, f"stock{uuid.uuid4().hex[:8]}", silent={"o-slow"})
    async with stock, served(waiting_orders(broker)) as client:
        done = await client.post("/orders/o-1", params={"wait": 10})
        assert (done.status_code, done.json()["status"]) == (200, StockReserved.event_type)
        late = await client.post("/orders/o-slow", params={"wait": 0.2})
        assert late.status_code == 202
        assert late.headers["Location"] == "/orders/o-slow"
        assert late.json() == {"order_id": "o-slow", "status": "pending"}
