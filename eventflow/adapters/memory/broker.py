"""The in-memory broker: partitioned consumer groups with acks, redelivery and backpressure.

Brokers opened with the same ``memory://NAME`` in one process share a hub (``memory://``
is the default hub), so several apps in one process talk to each other. A hub lives while
a broker using it is open.

Each (group, pattern) pair is a durable consumer group created by its first ``subscribe``
or by ``declare``, and it exists while its hub does. A new group begins with the next
message published (``start="latest"``) or with the newest ``retain`` messages the hub keeps
(``start="earliest"``); an existing one keeps what it has.
Its messages are spread over ``partitions`` by key hash (keyless messages round-robin), and
partitions are shared among the group's live members. A partition changes owner only once
its in-flight messages are settled, so one key is never handled by two members at once.
Messages not acked when a member leaves go back to the front of their partition. A
delivery's ``metadata`` is its partition and its offset in that partition, as in Kafka.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ...errors import BackpressureError, BrokerError, ConfigurationError, MessageRefusedError
from ...groups import check_group, log_new_group
from ...patterns import matches, validate_pattern, validate_topic
from ...ports import Lag, StartPosition
from ...urls import count_option, seconds_option, split_url, url_options
from .config import MemoryBrokerConfig
from .groups import Group, MemorySubscription
from .hub import Hub, hubs

if TYPE_CHECKING:
    from ...supervision import Supervisor

__all__ = ["MemoryBroker", "MemoryBrokerConfig"]

_SPACE_POLL = 0.05
_URL_OPTIONS = (
    "partitions",
    "max_pending",
    "publish_timeout",
    "max_message_bytes",
    "retain",
    "retain_bytes",
)


class MemoryBroker:
    """A real in-process broker with the semantics of the :class:`~eventflow.ports.Broker` port.

    ``MemoryBroker()`` joins the default hub; ``MemoryBroker(MemoryBrokerConfig(name="x"))``
    (or ``open_broker("memory://x")``) joins hub ``x``.
    """

    def __init__(self, config: MemoryBrokerConfig | None = None) -> None:
        self.config = config or MemoryBrokerConfig()
        cfg = self.config
        if cfg.partitions < 1 or cfg.max_pending < 1 or cfg.max_message_bytes < 1:
            raise ConfigurationError(
                "memory broker partitions, max_pending and max_message_bytes must be >= 1"
            )
        self._hub: Hub | None = None
        self._subs: set[MemorySubscription] = set()
        self._max_bytes = cfg.max_message_bytes

    @classmethod
    def from_url(cls, url: str) -> MemoryBroker:
        """``memory://[hub][?option=value&...]``, options ``partitions``, ``max_pending``,
        ``publish_timeout``, ``max_message_bytes``, ``retain`` and ``retain_bytes`` (as in
        :class:`MemoryBrokerConfig`): brokers opened with one hub name share its groups; an
        unknown option is refused."""
        parts = split_url(url, kind="memory broker", form="memory://NAME")
        options = url_options(url, _URL_OPTIONS, kind="memory broker")
        defaults = MemoryBrokerConfig()
        return cls(
            MemoryBrokerConfig(
                name=parts.netloc + parts.path,
                partitions=count_option(url, options, "partitions", defaults.partitions),
                max_pending=count_option(url, options, "max_pending", defaults.max_pending),
                publish_timeout=seconds_option(
                    url, options, "publish_timeout", defaults.publish_timeout
                ),
                max_message_bytes=count_option(
                    url, options, "max_message_bytes", defaults.max_message_bytes
                ),
                retain=count_option(url, options, "retain", defaults.retain, minimum=0),
                retain_bytes=count_option(
                    url, options, "retain_bytes", defaults.retain_bytes, minimum=0
                ),
            )
        )

    @property
    def url(self) -> str:
        """The URL that opens a broker on the same hub."""
        return f"memory://{self.config.name}"

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Attach to the hub. Idempotent."""
        if self._hub is not None:
            return
        hub = hubs.get(self.config.name)
        if hub is None:
            hub = hubs[self.config.name] = Hub(self.config)
        hub.refs += 1
        self._hub = hub

    async def close(self) -> None:
        """Close this broker's subscriptions and detach; the hub goes with its last broker."""
        hub = self._hub
        if hub is None:
            return
        for sub in list(self._subs):
            sub.abandon()
        self._subs.clear()
        self._hub = None
        hub.refs -= 1
        if hub.refs <= 0 and hubs.get(self.config.name) is hub:
            del hubs[self.config.name]

    async def __aenter__(self) -> MemoryBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _live_hub(self) -> Hub:
        if self._hub is None:
            raise BrokerError("memory broker is not started: call `await broker.start()` first")
        return self._hub

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Hand ``payload`` to every group whose pattern matches ``topic``.

        Waits while a target group is full, up to ``publish_timeout``.
        """
        hub = self._hub
        if hub is None:
            raise BrokerError("memory broker is not started: call `await broker.start()` first")
        if len(payload) > self._max_bytes:
            raise MessageRefusedError(
                f"memory broker refuses the message for {topic!r}: {len(payload)} bytes, over "
                f"max_message_bytes={self._max_bytes}; it is not retried: make "
                "it smaller (NATS and Kafka refuse it too by default)"
            )
        groups = hub.routes.get(topic)
        if groups is None:
            validate_topic(topic)
            groups = hub.route(topic)
        hdrs = dict(headers) if headers else None
        for group in groups:
            if group.size >= group.capacity:
                # All or nothing: wait until every target group has room, then hand the
                # message to all of them at once, so a BackpressureError leaves none with it.
                await self._wait_space(groups, topic)
                break
        now = time.time()  # when the hub took it: after any wait for room
        for group in groups:
            group.put(topic, payload, key, hdrs, now)
        hub.retain((topic, payload, key, hdrs, now))

    async def _wait_space(self, groups: Sequence[Group], topic: str) -> None:
        """Wait until none of ``groups`` is full, up to ``publish_timeout`` in all."""
        # Woken at the low-water mark (one wake-up per batch of acks), or after a short
        # poll, so a group with a little room left by a slow consumer lets the publisher on.
        timeout = self.config.publish_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            full = next((g for g in groups if g.size >= g.capacity), None)
            if full is None:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(min(remaining, _SPACE_POLL)):
                    await full.space.wait()
            except TimeoutError:
                pass
        raise BackpressureError(
            f"group {full.name!r} ({full.pattern}) has {full.size} unacked messages "
            f"(max_pending={full.capacity}): publishing to {topic!r} found no moment within "
            f"{timeout}s when all its groups had room, so no group got the message; add "
            "consumers or slow the producer"
        )

    async def subscribe(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        temporary: bool = False,
    ) -> MemorySubscription:
        """Join ``group`` on ``pattern`` (created at ``start`` if the hub has no such group);
        returns once the membership is live. A ``temporary`` group begins with the next
        message and leaves the hub with its last member."""
        hub = self._live_hub()
        state, _ = self._group(hub, pattern, group, "latest" if temporary else start)
        if temporary and state.drop is None:
            state.drop = functools.partial(_drop_group, hub, state)
        sub = MemorySubscription(state, self._subs)
        state.members.append(sub)
        state.rebalance()
        self._subs.add(sub)
        return sub

    async def declare(
        self,
        pattern: str,
        *,
        group: str,
        start: StartPosition = "latest",
        create: bool = True,
    ) -> bool:
        """Whether the hub had ``group`` on ``pattern``; with ``create`` one it had not is
        made now at ``start``, without members: messages published from then on wait in it
        (up to ``max_pending``) for its first member. The hub lives in this process, while
        one of its brokers is open, so a group declared here is gone with it."""
        hub = self._live_hub()
        if not create:
            check_group(pattern, group, start)
            return (group, pattern) in hub.groups
        return self._group(hub, pattern, group, start)[1]

    def _group(
        self, hub: Hub, pattern: str, group: str, start: StartPosition
    ) -> tuple[Group, bool]:
        """The hub's group ``group`` on ``pattern`` and whether it existed; a new one begins
        at ``start``: with the next message, or with the retained ones it matches."""
        begin = check_group(pattern, group, start)
        state = hub.groups.get((group, pattern))
        if state is not None:
            return state, True
        cfg = self.config
        state = hub.groups[(group, pattern)] = Group(
            group, pattern, cfg.partitions, cfg.max_pending
        )
        hub.routes.clear()
        if begin == "earliest":
            for topic, payload, key, headers, published in hub.retained:
                if matches(pattern, topic):
                    state.put(topic, payload, key, headers, published)
        log_new_group(group, pattern, begin)
        return state, False

    def problems(self) -> tuple[str, ...]:
        """Always empty: the in-process broker cannot be disconnected."""
        return ()

    async def lag(self, pattern: str, *, group: str) -> Lag:
        """The messages of ``group`` on ``pattern`` not yet acked (undelivered, out to a
        member, or to be delivered again) and the publish time of the oldest, on this
        process's clock (``time.time()`` when ``publish`` took it); ``Lag(0, None)`` for a
        group nobody created yet. Nothing is asked of anyone: it looks at the hub."""
        hub = self._live_hub()
        validate_pattern(pattern)
        state = hub.groups.get((group, pattern))
        if state is None or state.size == 0:
            return Lag(0, None)
        oldest = state.oldest()
        return Lag(state.size, None if oldest is None else datetime.fromtimestamp(oldest, UTC))

    def group_sizes(self) -> dict[tuple[str, str], int]:
        """Unacked messages per (group, pattern): the lag of each group, for status and tests."""
        hub = self._live_hub()
        return {k: g.size for k, g in hub.groups.items()}


def _drop_group(hub: Hub, group: Group) -> None:
    """Remove a temporary ``group`` from ``hub``: no message waits for it any more, and a
    publisher waiting for room in it goes on."""
    if hub.groups.get((group.name, group.pattern)) is group:
        del hub.groups[(group.name, group.pattern)]
        hub.routes.clear()
    for part in group.partitions:  # (its last member gave back what it held: all here)
        part.pending.clear()
        part.retry.clear()
    group.size = 0
    group.space.set()
