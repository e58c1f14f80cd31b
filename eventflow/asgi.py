"""Run an ``App`` inside an ASGI application's lifespan (FastAPI, Starlette) and reach it
from request handlers (``pip install 'eventflow[fastapi]'``)::

    from typing import Annotated
    from fastapi import Depends, FastAPI
    from eventflow import App
    from eventflow.asgi import current_app, lifespan, readyz

    events = App("orders", broker="nats://127.0.0.1:4222", handlers=[...])
    http = FastAPI(lifespan=lifespan(events))
    http.add_api_route("/readyz", readyz)

    @http.post("/orders")
    async def place(body: OrderIn, app: Annotated[App, Depends(current_app)]) -> dict[str, str]:
        env = await app.publish(OrderPlaced(...), key=body.order_id)
        return {"id": env.id}

- :func:`lifespan` starts the app before the server accepts its first request (so every
  subscription is live by then, as ``async with app`` promises) and stops it after the
  server has finished its requests: fetching stops and in-flight handlers drain within the
  app's ``grace_period``. It wraps a lifespan of the user's own (``inner=``), which runs
  inside it: its start-up may publish, and it ends before the app stops.
- :func:`current_app` is a FastAPI dependency (or a plain function of a Starlette request)
  giving the app the lifespan runs; tests replace it with ``dependency_overrides``.
- :func:`readyz` is an endpoint answering 200 while the app is ready and 503 once a
  component failed for good (or the app is not running), with the body of the app's own
  ``/readyz``, so the server's readiness probe learns of a failure. A failure also makes
  the lifespan's shutdown fail with the ``ComponentFailedError``, which the server logs;
  ``lifespan(app, on_failure=terminate)`` stops the server at once instead, so that the
  process is restarted as ``eventflow run`` is.

Only Starlette's ``HTTPConnection`` and ``JSONResponse`` are imported (FastAPI injects the
request by that annotation); FastAPI itself is never imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from .app import App
from .errors import ComponentFailedError, ConfigurationError, MissingDependencyError
from .runtime.health import readiness_body

try:
    from starlette.requests import HTTPConnection
    from starlette.responses import JSONResponse
except ImportError as exc:  # pragma: no cover - the test extra installs it
    raise MissingDependencyError("starlette", "fastapi") from exc

__all__ = ["STATE_ATTRIBUTE", "Lifespan", "current_app", "lifespan", "readyz", "terminate"]

_log = logging.getLogger("eventflow.asgi")

STATE_ATTRIBUTE = "eventflow"
"""The attribute of the ASGI app's ``state`` that holds the running ``App``."""

Lifespan = Callable[[Any], AbstractAsyncContextManager[Mapping[str, Any] | None]]
"""A Starlette/FastAPI lifespan: called with the ASGI app, an async context manager that
may yield the lifespan state (a mapping) or None."""


def terminate(failure: ComponentFailedError) -> None:
    """An ``on_failure`` for :func:`lifespan`: send this process SIGTERM, so that the server
    shuts down as on ``kill`` (its requests finished, the app drained, the failure logged)
    and exits; its supervisor (systemd, Kubernetes) then restarts it, as it would restart
    ``eventflow run`` after a failure."""
    _log.error("%s; stopping the server (SIGTERM) so that it is restarted", failure)
    signal.raise_signal(signal.SIGTERM)


def lifespan(
    app: App,
    *,
    inner: Lifespan | None = None,
    on_failure: Callable[[ComponentFailedError], object] | None = None,
) -> Lifespan:
    """A lifespan for ``FastAPI(lifespan=...)`` / ``Starlette(lifespan=...)`` that runs
    ``app``: started (every subscription live) before the server serves, stopped (draining
    in-flight handlers within ``app.grace_period``) after it has finished its requests.

    ``inner`` is the user's own lifespan, entered once the app runs and left before it
    stops; whatever state it yields is yielded on. The app is kept as
    ``asgi_app.state.eventflow`` for :func:`current_app`. A start that fails (a broker
    unreachable) fails the server's start-up; a component that failed for good while
    serving is raised at shutdown (its ``ComponentFailedError``), and, with ``on_failure``,
    passed to it as soon as it happens (:func:`terminate` stops the server)."""

    @contextlib.asynccontextmanager
    async def run(asgi_app: Any) -> AsyncIterator[Mapping[str, Any] | None]:
        state = getattr(asgi_app, "state", None)
        if state is not None:
            setattr(state, STATE_ATTRIBUTE, app)
        try:
            async with app, _watching(app, on_failure):
                if inner is None:
                    yield None
                else:
                    async with inner(asgi_app) as theirs:
                        yield theirs
        finally:
            if state is not None and getattr(state, STATE_ATTRIBUTE, None) is app:
                delattr(state, STATE_ATTRIBUTE)

    return run


@contextlib.asynccontextmanager
async def _watching(
    app: App, on_failure: Callable[[ComponentFailedError], object] | None
) -> AsyncIterator[None]:
    """Call ``on_failure`` with the app's failure when one happens, while the block runs."""
    if on_failure is None:
        yield
        return

    async def watch() -> None:
        on_failure(await app.wait_failed())

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        watcher.cancel()
        await asyncio.wait({watcher})
        if not watcher.cancelled() and watcher.exception() is not None:
            _log.error("on_failure raised", exc_info=watcher.exception())


def current_app(connection: HTTPConnection) -> App:
    """The ``App`` the ASGI app's :func:`lifespan` runs: ``Depends(current_app)`` in a
    FastAPI endpoint, or ``current_app(request)`` in a Starlette one."""
    found = getattr(connection.app.state, STATE_ATTRIBUTE, None)
    if not isinstance(found, App):
        raise ConfigurationError(
            "no eventflow App runs in this ASGI app: create it with "
            "FastAPI(lifespan=eventflow.asgi.lifespan(app)) (the server must run lifespans: "
            "uvicorn's --lifespan on or auto)"
        )
    return found


async def readyz(connection: HTTPConnection) -> JSONResponse:
    """A readiness endpoint (``http.add_api_route("/readyz", readyz)``): 200 while the app
    is ready (running, every component well), else 503; the body is the app's own
    ``/readyz`` one: ``{"app", "status", "problems"}``."""
    app = current_app(connection)
    ready, health = app.readiness()
    return JSONResponse(readiness_body(app.name, health), status_code=200 if ready else 503)
