"""What each HTTP service of the shop serves besides its own routes: a FastAPI app whose
lifespan runs the service's eventflow ``App`` (``eventflow.asgi``), with ``/healthz``,
``/readyz`` and ``/metrics``. FastAPI is imported only when an HTTP app is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eventflow import App, MissingDependencyError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from eventflow.asgi import Lifespan

__all__ = ["service_http"]


def service_http(app: App, title: str, *, inner: Lifespan | None = None) -> FastAPI:
    """A FastAPI app titled ``title`` that runs ``app`` for as long as it serves (``inner``:
    the service's own lifespan, entered once ``app`` runs) and answers ``/healthz``,
    ``/readyz`` and ``/metrics`` (503 while ``SHOP_METRICS=0``); the service adds its
    routes to it. Raises ``MissingDependencyError`` without FastAPI (pip install
    'eventflow[fastapi]')."""
    try:
        from fastapi import FastAPI
        from fastapi.responses import PlainTextResponse, Response
    except ImportError:
        raise MissingDependencyError("fastapi", "fastapi") from None

    from eventflow.asgi import lifespan, readyz

    http = FastAPI(title=title, lifespan=lifespan(app, inner=inner))
    http.add_api_route("/readyz", readyz)

    @http.get("/healthz")
    async def healthz() -> Response:
        return PlainTextResponse("ok")

    @http.get("/metrics")
    async def metrics() -> Response:
        if app.metrics is None:
            return PlainTextResponse("metrics are off (SHOP_METRICS=0)", status_code=503)
        body, content_type = await app.metrics.exposition()
        return Response(body, media_type=content_type)

    return http
