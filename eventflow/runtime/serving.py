"""``App.serve``: run an app until a stop signal, then shut it down gracefully.

A signal (or the ``stop`` event) during start-up ends the start at once; a component that
cannot recover stops the app and its ``ComponentFailedError`` is raised to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sized
from typing import Protocol

from ..errors import ComponentFailedError

__all__ = ["serve_app"]

_log = logging.getLogger("eventflow.app")


class App(Protocol):
    """What serving needs of an ``eventflow.App``."""

    @property
    def name(self) -> str: ...

    @property
    def consumers(self) -> Sized: ...

    @property
    def failure(self) -> ComponentFailedError | None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def wait_failed(self) -> ComponentFailedError: ...


async def serve_app(
    app: App,
    stop: asyncio.Event,
    *,
    handle_signals: bool,
) -> None:
    """Start ``app``, serve until ``stop`` is set (or SIGINT/SIGTERM when
    ``handle_signals``) or a component failed for good (``app.wait_failed``), then stop
    it; raise the app's failure, if one happened."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM) if handle_signals else ():
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread or no signal support: rely on `stop`
    try:
        await _serve(app, stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def _serve(app: App, stop: asyncio.Event) -> None:
    stopping = asyncio.ensure_future(stop.wait())
    try:
        starting = asyncio.ensure_future(app.start())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not starting.done() and not stopping.done():  # serve() itself cancelled
                starting.cancel()
                await asyncio.wait({starting})
        if not starting.done():
            _log.info("app %s: start-up interrupted; stopping", app.name)
            starting.cancel()
            await asyncio.wait({starting})
            if not starting.cancelled() and starting.exception() is None:
                await app.stop()  # it finished starting just as it was cancelled
            return
        starting.result()  # a failed start-up raises here
        _log.info("app %s running (%d subscriptions)", app.name, len(app.consumers))
        failed = asyncio.ensure_future(app.wait_failed())
        try:
            await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            _log.info("app %s stopping", app.name)
            await app.stop()
        if app.failure is not None:
            raise app.failure
    finally:
        stopping.cancel()
