"""The NATS broker's first connection: bounded by ``connect_timeout``, interruptible, and
leaving nothing behind when it fails.

nats-py retries a first connection for ever when reconnecting is unlimited, which is what
the broker wants *after* it has connected once (a server restart must not end the app), but
not before: an app pointed at a wrong port, a server without JetStream or a host that
accepts connections and stays silent would hang in ``start`` and log every retry. So the
whole first connection (the client handshake, then the check of the stream and buckets) runs
under one deadline; on expiry or cancellation the half-made client is closed (its socket and
tasks with it) and ``start`` raises a ``BrokerError`` naming the URL and what to check.

Before the client starts, each server is asked for a plain TCP connection (closed at once):
if every one refuses it, nothing listens there and ``start`` fails at once instead of
waiting out ``connect_timeout`` for a server that is not running. A server that accepts, or
does not answer within a moment, is left to the client and the deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from ...errors import BrokerError
from ..tcp import open_tcp
from .config import NatsBrokerConfig

__all__ = ["connect_first", "header_bytes"]

_log = logging.getLogger("eventflow.nats")
RECONNECT_WAIT = 0.25
"""Seconds between two reconnection attempts to one server (after the first connection)."""
_SETUP_RETRY = 0.1
_MIN_ATTEMPT = 0.5
_PROBE = 1.0
"""Longest wait for the TCP probe of the servers (a refusal comes back in a round trip)."""
_DEFAULT_PORT = 4222
# JetStream answers "no responders" / 503 while the server is still starting it, and for
# good when it is not enabled: the setup is tried again until the deadline tells which.
_NOT_READY = (ServiceUnavailableError, NoRespondersError, NatsTimeoutError)


async def connect_first(
    cfg: NatsBrokerConfig,
    url: str,
    setup: Callable[[JetStreamContext], Awaitable[None]],
    *,
    on_reconnected: Callable[[], Awaitable[None]],
    on_disconnected: Callable[[], Awaitable[None]],
    on_error: Callable[[Exception], Awaitable[None]],
) -> tuple[Client, JetStreamContext]:
    """Connect a client to ``cfg.servers`` and run ``setup`` (stream and buckets) within
    ``cfg.connect_timeout``; raise ``BrokerError`` naming ``url`` (or what ``setup`` raised,
    such as a ``ConfigurationError``) after closing the client if that fails or is cancelled.

    The callbacks stay the client's for its life (nats-py calls them on its events)."""
    nc = Client()
    not_ready: BaseException | None = None
    last_error: Exception | None = None

    async def error_cb(exc: Exception) -> None:
        nonlocal last_error
        last_error = exc  # named in the BrokerError if the first connection fails
        await on_error(exc)

    # One silent server must leave time for the others within the one deadline.
    attempt = max(_MIN_ATTEMPT, cfg.connect_timeout / len(cfg.servers))
    try:
        async with asyncio.timeout(cfg.connect_timeout) as deadline:
            refused = await _all_refuse(cfg.servers, min(_PROBE, attempt))
            if refused is not None:
                raise BrokerError(_refused(url, refused)) from refused
            await nc.connect(
                servers=list(cfg.servers),
                name=cfg.name,
                user=cfg.user,
                password=cfg.password,
                token=cfg.token,
                connect_timeout=attempt,  # type: ignore[arg-type]  # a float works
                reconnect_time_wait=RECONNECT_WAIT,  # type: ignore[arg-type]
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                reconnected_cb=on_reconnected,
                disconnected_cb=on_disconnected,
                error_cb=error_cb,
            )
            js = nc.jetstream(timeout=cfg.request_timeout)
            while True:
                try:
                    await setup(js)
                    break
                except _NOT_READY as exc:
                    not_ready = exc
                    await asyncio.sleep(_SETUP_RETRY)
    except TimeoutError as exc:
        connected, silent = nc.is_connected, nc.is_connecting
        await discard(nc)
        if not deadline.expired():
            raise  # not ours: a bug below, reported as it is
        if connected or not_ready is not None:
            raise BrokerError(_no_jetstream(cfg, url, not_ready)) from exc
        if silent:
            raise BrokerError(_silent(cfg, url)) from exc
        raise BrokerError(_unreachable(cfg, url, last_error)) from exc
    except NatsError as exc:
        await discard(nc)
        raise BrokerError(
            f"setting up JetStream on NATS at {url} failed: {type(exc).__name__}: "
            f"{exc}; check the server's JetStream limits and this account's permissions"
        ) from exc
    except BaseException:
        await discard(nc)
        raise
    return nc, js


async def discard(nc: Client) -> None:
    """Close a client that is connecting, connected or reconnecting, so that no socket
    or task of it is left; errors of a connection already gone are only logged."""
    try:
        await nc.close()
    except Exception as exc:
        _log.debug("closing the NATS client: %s", exc)
    # Between two reconnection attempts nats-py leaves the client marked closed, and close()
    # then returns at once, leaving its subscriptions' tasks (the request inbox's) running.
    for sub in list(nc._subs.values()):
        sub._stop_processing()
    nc._subs.clear()


async def _all_refuse(servers: tuple[str, ...], wait: float) -> OSError | None:
    """One of the refusals if every server refuses a TCP connection, else None (one
    accepted, failed otherwise or did not answer within ``wait`` seconds)."""

    async def refusal(server: str) -> OSError | None:
        parts = urlsplit(server)
        if parts.scheme not in ("nats", "tls") or not parts.hostname:
            return None  # a websocket URL: its port is not guessed, the client tries it
        try:
            async with asyncio.timeout(wait):
                _, writer = await open_tcp(parts.hostname, parts.port or _DEFAULT_PORT)
        except ConnectionRefusedError as exc:
            return exc
        except (OSError, TimeoutError):
            return None
        writer.close()
        return None

    found = await asyncio.gather(*(refusal(s) for s in servers))
    if all(r is not None for r in found):
        return found[0]
    return None


def _refused(url: str, error: OSError) -> str:
    return (
        f"cannot connect to NATS at {url}: the connection was refused ({error}), so nothing "
        "listens there; check that nats-server is running and that the URL names its "
        "client port (4222 by default)"
    )


def _unreachable(cfg: NatsBrokerConfig, url: str, last: Exception | None) -> str:
    why = f" (last error: {type(last).__name__}: {last})" if last is not None else ""
    return (
        f"cannot connect to NATS at {url} within connect_timeout={cfg.connect_timeout:g}s"
        f"{why}; check that nats-server is running and reachable there, that the URL names "
        "its client port (4222 by default) and that the credentials are right; raise "
        "connect_timeout= on a slow network"
    )


def _silent(cfg: NatsBrokerConfig, url: str) -> str:
    return (
        f"cannot connect to NATS at {url}: a server accepted the connection but did "
        f"not greet it as a NATS server within connect_timeout={cfg.connect_timeout:g}s"
        "; check that the URL names the NATS client port (4222 by default), not a port of "
        "another protocol (such as Kafka's) or a proxy that cannot reach nats-server"
    )


def _no_jetstream(cfg: NatsBrokerConfig, url: str, error: BaseException | None) -> str:
    why = f" ({type(error).__name__}: {error})" if error is not None else ""
    return (
        f"connected to NATS at {url}, but JetStream did not answer within "
        f"connect_timeout={cfg.connect_timeout:g}s{why}; check that the server runs with "
        "JetStream enabled (nats-server -js, or `jetstream {}` in its config) and that this "
        "account may use it"
    )


def header_bytes(headers: dict[str, str]) -> int:
    """The size of ``headers`` on the wire (``NATS/1.0`` line, ``key: value`` lines, blank
    line): the server counts it with the payload against its ``max_payload``."""
    size = 12
    for k, v in headers.items():
        size += len(k.strip().encode()) + len(v.strip().encode()) + 4
    return size
