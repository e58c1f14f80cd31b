"""Request-reply: ``app.request`` sends a command and waits for the reply it caused.

A reply is an ordinary message a participant publishes while handling the command
(``ctx.publish``), so it goes to its ordinary topic with ``causation_id`` = the command's id
and reaches every group on that topic (a saga's included). Nothing about the participant
changes, and nothing is published twice.

Each ``App`` object listens for replies in a consumer group of its own
(``<app>.replies.<12 hex digits>``), one subscription per reply topic, joined at the live
end (``start="latest"``) the first time a request expects a type of that topic, and before
its command is published, so a fast reply is not missed. Two instances of one app, or two
apps of one name, never share that group: each gets every message of the topic and keeps
those caused by its own waiting requests. It reads the causation id from the bytes
(``envelope.peek_causation_id``), so a message caused by another instance's command (or
by no request at all) is acked without being decoded; only a match is decoded, and a match
of a type the request does not expect is skipped. A reply whose request gave up (timed out,
was cancelled) is dropped and counted (``late``); the counters are ``app.stats()
["requests"]``.

The listeners are components of the app's supervisor (restarted after a transient failure)
and end with the app. Their groups are temporary (``Broker.subscribe(temporary=True)``):
each goes with its subscription, so no group is left to fill with replies nobody reads. A
listener restarted after a failure joins at the live end again: a reply published while it
was down is missed, and its request times out. See ``docs/semantics.md``, "Request-reply".
"""

from __future__ import annotations

import asyncio
import logging
import math
import types
import typing
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Union

from ..envelope import Envelope, new_id, peek_causation_id
from ..errors import BrokerError, ConfigurationError, DecodeError, RequestTimeoutError
from ..events import Event, EventRegistry, envelope_for
from ..ports import Broker, Delivery, Subscription

if TYPE_CHECKING:
    from ..supervision import Supervisor

__all__ = ["RequestHost", "RequestStats", "Requests", "expected_types"]

_log = logging.getLogger("eventflow.requests")
_FETCH = 100
_FETCH_WAIT = 1.0
_FINISHED_MAX = 10_000  # ids of requests that ended, to tell a late reply (bounded)


def expected_types(expect: object) -> dict[str, type[Event]]:
    """The Event classes of ``expect`` (one class or a union of them) by type name."""
    args = (
        typing.get_args(expect)
        if typing.get_origin(expect) in (Union, types.UnionType)
        else (expect,)
    )
    found: dict[str, type[Event]] = {}
    for cls in args:
        if not (isinstance(cls, type) and issubclass(cls, Event) and cls.event_type):
            raise ConfigurationError(
                f"expect= takes an Event class or a union of them "
                f"(expect=StockReserved | StockRejected), got {expect!r}"
            )
        found[cls.event_type] = cls
    return found


@dataclass
class RequestStats:
    """Counters of an app's requests (``app.stats()["requests"]``)."""

    sent: int = 0
    """Commands sent by ``app.request``."""
    replied: int = 0
    """Requests answered in time."""
    timed_out: int = 0
    """Requests that raised ``RequestTimeoutError``."""
    late: int = 0
    """Replies dropped because their request had given up."""
    skipped: int = 0
    """Messages on reply topics not caused by a waiting request (read without decoding),
    or caused by one and of a type it does not expect."""

    def as_dict(self) -> dict[str, int]:
        """The counters as a dict."""
        return {
            "sent": self.sent,
            "replied": self.replied,
            "timed_out": self.timed_out,
            "late": self.late,
            "skipped": self.skipped,
        }


@dataclass
class _Waiting:
    """One request waiting: the types it expects and the future its reply completes."""

    expect: dict[str, type[Event]]
    reply: asyncio.Future[Event] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class RequestHost(Protocol):
    """What requests need of the app that sends them (``App`` satisfies it)."""

    @property
    def name(self) -> str:
        """The app's name: the commands' ``source``, and the stem of its reply group."""

    @property
    def broker(self) -> Broker:
        """The broker the reply listeners subscribe on."""

    @property
    def registry(self) -> EventRegistry:
        """The event types replies are decoded with."""

    async def publish(self, message: Envelope, *, topic: str | None = None) -> Envelope:
        """Send a command as ``App.publish`` does."""


class Requests:
    """The request-reply side of one ``App``: its reply listeners and waiting requests.

    ``running`` returns the supervisor of the app's current run, or None while it is not
    running: the listeners are its components, and a new run starts new ones."""

    def __init__(self, app: RequestHost, running: Callable[[], Supervisor | None]) -> None:
        self._app = app
        self._running = running
        self.group = f"{app.name}.replies.{new_id()[-12:]}"
        """The consumer group this app object's reply listeners share (its own)."""
        self.stats = RequestStats()
        self._waiting: dict[str, _Waiting] = {}
        # command id -> the types it expected, for requests that gave up (late replies)
        self._gave_up: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._owner: Supervisor | None = None  # the app run the listeners belong to
        self._listening: dict[str, asyncio.Future[None]] = {}  # topic -> joined

    async def request(
        self,
        message: Event,
        *,
        expect: object,
        timeout: float,
        key: str | None,
        topic: str | None,
        headers: Mapping[str, str] | None,
        correlation_id: str | None,
    ) -> Event:
        """``App.request``: listen on the reply topics, send, wait for the reply."""
        if not isinstance(message, Event):
            raise ConfigurationError(
                f"app.request sends an Event instance (the command), got {message!r}"
            )
        wanted = expected_types(expect)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ConfigurationError(f"timeout= takes seconds above 0, got {timeout!r}")
        if not 0 < timeout < math.inf:
            raise ConfigurationError(f"timeout= takes seconds above 0, got {timeout!r}")
        await self._listen(sorted(wanted))
        app = self._app
        env = envelope_for(
            message, source=app.name, key=key, headers=headers, correlation_id=correlation_id
        )
        waiting = self._waiting[env.id] = _Waiting(wanted)
        try:
            await app.publish(env, topic=topic)
            self.stats.sent += 1
            try:
                async with asyncio.timeout(timeout):
                    reply = await waiting.reply
            except TimeoutError:
                self.stats.timed_out += 1
                raise RequestTimeoutError(env.id, tuple(wanted), float(timeout)) from None
        finally:
            del self._waiting[env.id]
            if not waiting.reply.done() or waiting.reply.cancelled():
                waiting.reply.cancel()
                self._remember(env.id, frozenset(wanted))
        self.stats.replied += 1
        return reply

    def _remember(self, command_id: str, expected: frozenset[str]) -> None:
        gave_up = self._gave_up
        gave_up[command_id] = expected
        if len(gave_up) > _FINISHED_MAX:
            gave_up.popitem(last=False)

    async def _listen(self, topics: list[str]) -> None:
        """Join the reply group on each of ``topics`` not listened to yet in this run of the
        app; return once every one is live."""
        supervisor = self._running()
        if supervisor is None:
            raise BrokerError(
                f"app {self._app.name!r} is not running: request inside `async with app:` "
                "or after `await app.start()`"
            )
        if supervisor is not self._owner:  # a new run: the old listeners ended with the last
            self._owner, self._listening = supervisor, {}
        joins = []
        for topic in topics:
            joined = self._listening.get(topic)
            if joined is None or (joined.done() and joined.exception() is not None):
                joined = self._listening[topic] = asyncio.get_running_loop().create_future()
                supervisor.spawn(f"request replies {topic}", self._listener(topic, joined))
            joins.append(joined)
        for joined in joins:
            await asyncio.shield(joined)

    def _listener(self, topic: str, joined: asyncio.Future[None]) -> Any:
        """The run of the listener component of ``topic``: join (and say so through
        ``joined``), then take replies until the app stops."""

        async def run() -> None:
            try:
                sub = await self._app.broker.subscribe(topic, group=self.group, temporary=True)
            except Exception as exc:
                if joined.done():
                    raise  # a rejoin after a failure: the supervisor tries again
                # The first join: the request waiting on it fails with the error, and the
                # next request for the topic starts a new listener.
                joined.set_exception(exc)
                joined.exception()  # (retrieved: the requests see it)
                return
            if not joined.done():
                joined.set_result(None)
            try:
                await self._take(sub)
            finally:
                await sub.close()

        return run

    async def _take(self, sub: Subscription) -> None:
        while True:
            for delivery in await sub.fetch(_FETCH, _FETCH_WAIT):
                self._read(delivery)
                await delivery.ack()

    def _read(self, delivery: Delivery) -> None:
        """Give a delivery to the request it answers, if it does; count it otherwise."""
        payload = delivery.payload
        cause = peek_causation_id(payload)
        if cause is not None and cause not in self._waiting and cause not in self._gave_up:
            self.stats.skipped += 1  # another instance's reply, or no reply: not decoded
            return
        try:
            env = Envelope.from_bytes(payload)
        except DecodeError:
            self.stats.skipped += 1  # not an envelope: nobody's reply
            return
        cause = env.causation_id or ""
        waiting = self._waiting.get(cause)
        if waiting is None:
            expected = self._gave_up.get(cause)
            if expected is not None and env.type in expected:
                self.stats.late += 1
                _log.info("dropped %s %s: its request %s had given up", env.type, env.id, cause)
            else:
                self.stats.skipped += 1
            return
        cls = waiting.expect.get(env.type)
        if cls is None or waiting.reply.done():
            self.stats.skipped += 1  # caused by the command, not a type it waits for
            return
        try:
            waiting.reply.set_result(self._app.registry.decode_as(env, cls))
        except Exception as exc:  # the reply itself is bad (a DecodeError, or a validator
            waiting.reply.set_exception(exc)  # raising): the one waiting gets it, not the app

    def stopped(self) -> None:
        """The app stopped (its listeners ended with its supervisor): fail the requests
        still waiting, which no reply can reach any more."""
        self._owner, self._listening = None, {}
        for command_id, waiting in self._waiting.items():
            if not waiting.reply.done():
                waiting.reply.set_exception(
                    BrokerError(
                        f"app {self._app.name!r} stopped while request {command_id} waited "
                        "for its reply; the command was sent"
                    )
                )
