"""A compensation never overtakes the command it undoes (DESIGN section 5, "Abort of a step in
flight"), for any idempotent handler, on memory, memory + SQLite, NATS + PostgreSQL and
Kafka (Tansu) + PostgreSQL.

The participant's group handles a command (``it.comp.reserve``) and its compensation
(``it.comp.release``, header ``eventflow-compensates`` = the command's envelope id) on two
topics, so nothing orders them. A compensation that reaches the group first cancels the
command: neither handler is called, the group's dedup records both, and the command is
skipped when it arrives. A command held inside ``ctx.transaction()`` while its compensation
arrives loses at its commit and rolls back. Each handler's effect is a reply it publishes
in its transaction (through the outbox) and, on PostgreSQL, a row in a table of its own.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, Context, Envelope, Event, subscribe
from eventflow.adapters.memory import MemoryStore
from eventflow.envelope import new_id
from eventflow.events import envelope_for
from eventflow.headers import COMPENSATES_HEADER
from eventflow.ports import DedupStore, Store
from eventflow.runtime.compensation import Decision, decide
from eventflow.stores import dedup_for, store_for
from eventflow.testing.postgres import isolated_schema, postgres_url
from eventflow.testing.redis import redis_url

Wait = Callable[..., Awaitable[None]]
TIMEOUT = 30.0


class CompReserve(Event, type="it.comp.reserve"):
    """The command: hold stock for an order."""

    order_id: str


class CompRelease(Event, type="it.comp.release"):
    """Its compensation: give the stock back."""

    order_id: str


class CompAbort(Event, type="it.comp.abort"):
    """Tells the coordinator to compensate ``command_id``."""

    order_id: str
    command_id: str


class CompReserved(Event, type="it.compdone.reserved"):
    """The reserve handler's reply (its effect on the broker)."""

    order_id: str


class CompReleased(Event, type="it.compdone.released"):
    """The release handler's reply."""

    order_id: str


# -- where the apps run ------------------------------------------------------------------------


@dataclass
class Place:
    """A broker + store setup of the test's own."""

    name: str
    broker: str
    store: str | Store
    sql: bool

    def app(self, name: str, handlers: list[Any]) -> App:
        """An app on this setup."""
        return App(name, broker=self.broker, store=self.store, handlers=handlers)


@pytest.fixture
async def comp_schema() -> AsyncIterator[str]:
    """A PostgreSQL schema of the test's own."""
    async with isolated_schema(postgres_url()) as url:
        yield url


SERVERS = [
    pytest.param("memory", id="memory"),
    pytest.param("nats-postgres", id="nats-postgres", marks=pytest.mark.service("nats")),
    pytest.param("kafka-postgres", id="kafka-postgres", marks=pytest.mark.service("kafka")),
]
EVERY = [*SERVERS, pytest.param("memory-sqlite", id="memory-sqlite")]


@pytest.fixture
def place(request: pytest.FixtureRequest, broker_url: str, tmp_path: Path) -> Place:
    """The setup named by the test's parameter."""
    kind: str = request.param
    unique = uuid.uuid4().hex[:10]
    if kind == "memory":
        return Place(kind, broker_url, MemoryStore(), sql=False)
    if kind == "memory-sqlite":
        return Place(kind, broker_url, f"sqlite:///{tmp_path / 'comp.db'}", sql=True)
    schema: str = request.getfixturevalue("comp_schema")
    if kind == "nats-postgres":
        nats: str = request.getfixturevalue("nats_url")
        return Place(kind, f"{nats}?stream=EFCOMP{unique}&storage=memory", schema, sql=True)
    assert kind == "kafka-postgres", kind
    kafka: str = request.getfixturevalue("kafka_url")
    return Place(kind, f"{kafka}&topic_prefix=t{unique}.", schema, sql=True)


# -- the participant ---------------------------------------------------------------------------


@dataclass
class Participant:
    """The participant's handlers (one group) and what they did."""

    group: str
    sql: bool
    reserve_calls: list[str] = field(default_factory=list)
    release_calls: list[tuple[str, str | None]] = field(default_factory=list)
    """(order id, ctx.compensates) of each call of the release handler."""
    nothing_to_undo: list[str] = field(default_factory=list)
    """Orders whose release handler ran before their reserve had taken effect: the
    compensation overtook its command (on PostgreSQL: no reserved row in its transaction;
    on memory: the command not recorded)."""
    replies: list[tuple[str, str]] = field(default_factory=list)
    """(reply type, order id) of every reply that reached the observer."""
    hold: dict[str, asyncio.Event] = field(default_factory=dict)
    """Order ids whose reserve handler waits inside its transaction until the event is set."""
    entered: dict[str, asyncio.Event] = field(default_factory=dict)
    jitter: float = 0.0
    """Up to this many seconds of sleep inside each handler's transaction."""

    def handlers(self) -> list[Any]:
        """The participant, the coordinator sending compensations, and the reply observer."""
        p = self

        @subscribe("it.comp.reserve", group=p.group, concurrency=8)
        async def reserve(event: CompReserve, ctx: Context) -> None:
            p.reserve_calls.append(event.order_id)
            async with ctx.transaction() as tx:
                if p.sql:
                    await tx.execute(_INSERT, event.order_id, "reserved")
                await ctx.publish(CompReserved(order_id=event.order_id))
                await p._pause(event.order_id)

        @subscribe("it.comp.release", group=p.group, concurrency=8)
        async def release(event: CompRelease, ctx: Context) -> None:
            p.release_calls.append((event.order_id, ctx.compensates))
            async with ctx.transaction() as tx:
                if p.sql:
                    done = (await tx.fetch(_RESERVED, event.order_id))[0][0]
                    await tx.execute(_INSERT, event.order_id, "released")
                else:
                    done = ctx.compensates is not None and await ctx.app.dedup.seen(
                        p.group, ctx.compensates
                    )
                if not done:
                    p.nothing_to_undo.append(event.order_id)
                await ctx.publish(CompReleased(order_id=event.order_id))
                await p._pause(event.order_id, held=False)

        @subscribe("it.comp.abort", group=f"{p.group}-coordinator")
        async def coordinator(event: CompAbort, ctx: Context) -> None:
            # As a saga sends it: through the outbox, the header in the envelope.
            async with ctx.transaction():
                await ctx.publish(
                    CompRelease(order_id=event.order_id),
                    headers={COMPENSATES_HEADER: event.command_id},
                )

        @subscribe("it.compdone.*", group=f"{p.group}-observer", concurrency=8)
        async def observe(env: Envelope) -> None:
            p.replies.append((env.type, str(env.data["order_id"])))

        return [reserve, release, coordinator, observe]

    async def _pause(self, order_id: str, *, held: bool = True) -> None:
        hold = self.hold.get(order_id) if held else None
        if hold is not None:
            self.entered[order_id].set()
            await hold.wait()
        elif self.jitter:
            await asyncio.sleep(random.uniform(0, self.jitter))

    def replies_of(self, order_id: str) -> list[str]:
        """The reply types observed for ``order_id``."""
        return sorted(t for t, o in self.replies if o == order_id)


_TABLE = "it_comp_effects"
_CREATE = f"CREATE TABLE IF NOT EXISTS {_TABLE} (order_id TEXT NOT NULL, what TEXT NOT NULL)"
_INSERT = f"INSERT INTO {_TABLE} (order_id, what) VALUES ($1, $2)"
_RESERVED = f"SELECT COUNT(*) FROM {_TABLE} WHERE order_id = $1 AND what = 'reserved'"


async def _rows(app: App) -> list[tuple[str, str]]:
    async with app.store.transaction() as tx:
        rows = await tx.fetch(f"SELECT order_id, what FROM {_TABLE} ORDER BY order_id, what")
    return [(str(a), str(b)) for a, b in rows]


async def _started(place: Place, p: Participant) -> App:
    app = place.app(f"comp-{p.group}", p.handlers())
    await app.__aenter__()
    if place.sql:
        async with app.store.transaction() as tx:
            await tx.execute(_CREATE)
    return app


def _stats(app: App, group: str, topic: str) -> dict[str, int]:
    """The consumer's counters (0 for one it does not have)."""
    return defaultdict(int, app.stats()[f"{group}:{topic}"])


def _settled(app: App, group: str, topic: str) -> int:
    """How many messages the consumer has brought to an outcome, whichever."""
    s = _stats(app, group, topic)
    return s["handled"] + s["duplicates"] + s["dead_lettered"] + s["cancels"] + s["cancelled"]


def _command(order_id: str) -> Envelope:
    """A command envelope whose id is known before it is published."""
    return envelope_for(CompReserve(order_id=order_id), source="test", key=order_id, id=new_id())


async def _normal_pair(app: App, p: Participant, order_id: str, waiter: Wait) -> None:
    """The control: a command handled first, then its compensation; both handlers run."""
    reserve, release = _stats(app, p.group, "it.comp.reserve"), None
    before = reserve["handled"]
    command = await app.publish(CompReserve(order_id=order_id), key=order_id)
    await waiter(
        lambda: _stats(app, p.group, "it.comp.reserve")["handled"] == before + 1,
        timeout=TIMEOUT,
        what=f"the command of {order_id} handled",
    )
    release = _stats(app, p.group, "it.comp.release")
    handled = release["handled"]
    await app.publish(CompAbort(order_id=order_id, command_id=command.id), key=order_id)
    await waiter(
        lambda: _stats(app, p.group, "it.comp.release")["handled"] == handled + 1,
        timeout=TIMEOUT,
        what=f"the compensation of {order_id} handled",
    )
    await waiter(
        lambda: p.replies_of(order_id) == ["it.compdone.released", "it.compdone.reserved"],
        timeout=TIMEOUT,
        what=f"both replies of {order_id}",
    )
    assert (order_id, command.id) in p.release_calls  # ctx.compensates names the command


# -- the rule on every setup -------------------------------------------------------------------


@pytest.mark.parametrize("place", EVERY, indirect=True)
async def test_a_compensation_that_overtakes_its_command_cancels_it(
    place: Place, waiter: Wait
) -> None:
    """The compensation (sent through a coordinator's outbox, as a saga sends it) arrives
    first: its handler is not called, the group records the command as cancelled by it and
    the compensation as handled; the command arriving afterwards is skipped, counted as
    cancelled. In the same app, the normal order (command, then compensation) runs both."""
    p = Participant(f"inv{uuid.uuid4().hex[:8]}", place.sql)
    app = await _started(place, p)
    try:
        command = _command("a")
        await app.publish(CompAbort(order_id="a", command_id=command.id), key="a")
        await waiter(
            lambda: _settled(app, p.group, "it.comp.release") == 1,
            timeout=TIMEOUT,
            what="an outcome for the compensation",
        )
        assert p.release_calls == []
        assert _stats(app, p.group, "it.comp.release")["cancels"] == 1
        dedup = app.dedup
        compensation = await dedup.cancelled_by(p.group, command.id)
        assert compensation is not None
        assert await dedup.seen(p.group, command.id)
        assert await dedup.seen(p.group, compensation)

        await app.publish(command)
        await waiter(
            lambda: _settled(app, p.group, "it.comp.reserve") == 1,
            timeout=TIMEOUT,
            what="an outcome for the command",
        )
        assert p.reserve_calls == []
        reserve = _stats(app, p.group, "it.comp.reserve")
        assert (reserve["cancelled"], reserve["handled"], reserve["duplicates"]) == (1, 0, 0)

        await _normal_pair(app, p, "b", waiter)
        assert p.reserve_calls == ["b"]
        assert [order for order, _ in p.release_calls] == ["b"]
        assert p.replies_of("a") == [] and p.nothing_to_undo == []
        release = _stats(app, p.group, "it.comp.release")
        assert (release["cancels"], release["handled"]) == (1, 1)
        if place.sql:
            assert await _rows(app) == [("b", "released"), ("b", "reserved")]
    finally:
        await app.__aexit__(None, None, None)


@pytest.mark.parametrize("place", SERVERS, indirect=True)
async def test_a_command_held_in_its_transaction_loses_to_its_compensation(
    place: Place, waiter: Wait
) -> None:
    """Fault injection: the command's handler is held inside ``ctx.transaction()`` (its row
    and its reply written) while the compensation arrives and cancels it. Released, the
    command's transaction finds its dedup record taken at commit and rolls back: no row, no
    reply, acked as cancelled; the compensation's handler was never called."""
    p = Participant(f"inv{uuid.uuid4().hex[:8]}", place.sql)
    p.hold["h"], p.entered["h"] = asyncio.Event(), asyncio.Event()
    app = await _started(place, p)
    try:
        command = await app.publish(CompReserve(order_id="h"), key="h")
        await waiter(p.entered["h"].is_set, timeout=TIMEOUT, what="the command's handler held")
        await app.publish(
            CompRelease(order_id="h"), key="h", headers={COMPENSATES_HEADER: command.id}
        )
        await waiter(
            lambda: _settled(app, p.group, "it.comp.release") == 1,
            timeout=TIMEOUT,
            what="an outcome for the compensation while its command is held",
        )
        assert p.release_calls == []
        assert _stats(app, p.group, "it.comp.release")["cancels"] == 1
        p.hold["h"].set()
        await waiter(
            lambda: _settled(app, p.group, "it.comp.reserve") == 1,
            timeout=TIMEOUT,
            what="an outcome for the held command",
        )
        assert p.reserve_calls == ["h"] and p.release_calls == []
        reserve = _stats(app, p.group, "it.comp.reserve")
        assert (reserve["cancelled"], reserve["handled"]) == (1, 0)
        assert reserve["applied_though_cancelled"] == 0
        assert await app.dedup.cancelled_by(p.group, command.id) is not None

        await _normal_pair(app, p, "c", waiter)  # a reply of "h" would have been relayed too
        assert p.replies_of("h") == [] and p.nothing_to_undo == []
        if place.sql:
            assert await _rows(app) == [("c", "released"), ("c", "reserved")]
    finally:
        await app.__aexit__(None, None, None)


@pytest.mark.parametrize("place", SERVERS, indirect=True)
async def test_commands_racing_their_compensations_end_consistent(
    place: Place, waiter: Wait
) -> None:
    """Commands and their compensations published close together, either first (each pair
    its own key, jitter inside every handler's transaction), so a compensation arrives
    before its command, while it is handled, or after: each pair ends with both applied or
    neither, never the compensation skipped with the command applied."""
    p = Participant(f"inv{uuid.uuid4().hex[:8]}", place.sql, jitter=0.02)
    app = await _started(place, p)
    orders = [f"r{n}" for n in range(16)]
    try:

        async def pair(order: str) -> None:
            command = _command(order)
            first, second = (
                app.publish(command),
                app.publish(
                    CompRelease(order_id=order), key=order, headers={COMPENSATES_HEADER: command.id}
                ),
            )
            if random.random() < 0.5:
                first, second = second, first
            await first
            await asyncio.sleep(random.uniform(0, 0.05))  # before, during or after the other
            await second

        await asyncio.gather(*(pair(order) for order in orders))

        await waiter(
            lambda: (
                _settled(app, p.group, "it.comp.reserve") == len(orders)
                and _settled(app, p.group, "it.comp.release") == len(orders)
            ),
            timeout=TIMEOUT,
            what="an outcome for every command and compensation",
        )
        assert p.nothing_to_undo == []  # no compensation ran before its command
        r = _stats(app, p.group, "it.comp.reserve")
        c = _stats(app, p.group, "it.comp.release")
        assert (r["handled"], r["cancelled"]) == (c["handled"], c["cancels"])
        assert r["handled"] + r["cancelled"] == len(orders)
        assert r["applied_though_cancelled"] == 0
        await waiter(
            lambda: len(p.replies) == 2 * r["handled"],
            timeout=TIMEOUT,
            what="the replies of every handled message",
        )
        for order in orders:
            assert p.replies_of(order) in ([], ["it.compdone.released", "it.compdone.reserved"])
        if place.sql:
            rows = await _rows(app)
            for order in orders:
                assert [w for o, w in rows if o == order] in ([], ["released", "reserved"])
    finally:
        await app.__aexit__(None, None, None)


# -- the edges, on memory ----------------------------------------------------------------------


async def test_a_command_applied_outside_its_transaction_while_cancelled_is_reported(
    broker_url: str, waiter: Wait, caplog: pytest.LogCaptureFixture
) -> None:
    """The window left open: a command handler whose effects are not in ctx.transaction()
    is held while its compensation cancels it. It has taken effect; recording it then
    finds the cancellation, which is logged as an error and counted."""
    group = f"inv{uuid.uuid4().hex[:8]}"
    entered, hold = asyncio.Event(), asyncio.Event()
    applied: list[str] = []

    @subscribe("it.comp.reserve", group=group)
    async def reserve(event: CompReserve) -> None:
        entered.set()
        await hold.wait()
        applied.append(event.order_id)

    @subscribe("it.comp.release", group=group)
    async def release(event: CompRelease) -> None:
        applied.append(f"undo {event.order_id}")

    async with App("comp-window", broker=broker_url, handlers=[reserve, release]) as app:
        command = await app.publish(CompReserve(order_id="w"), key="w")
        await waiter(entered.is_set, what="the command's handler running")
        compensation = await app.publish(
            CompRelease(order_id="w"), key="w", headers={COMPENSATES_HEADER: command.id}
        )
        await waiter(lambda: _settled(app, group, "it.comp.release") == 1)
        assert applied == []
        assert _stats(app, group, "it.comp.release")["cancels"] == 1
        with caplog.at_level(logging.ERROR, logger="eventflow.consumer"):
            hold.set()
            await waiter(lambda: _settled(app, group, "it.comp.reserve") == 1)
        assert applied == ["w"]
        reserve = _stats(app, group, "it.comp.reserve")
        assert (reserve["handled"], reserve["applied_though_cancelled"]) == (1, 1)
        [record] = [r for r in caplog.records if "took effect although" in r.getMessage()]
        assert command.id in record.getMessage() and compensation.id in record.getMessage()


async def test_a_subscription_without_dedup_runs_every_compensation_and_says_so_once(
    broker_url: str, waiter: Wait, caplog: pytest.LogCaptureFixture
) -> None:
    """``idempotent=False`` keeps no records, so a compensation cannot cancel anything: its
    handler runs (ctx.compensates set), and a warning says so once."""
    calls: list[str | None] = []

    @subscribe("it.comp.release", group="nodedup", idempotent=False)
    async def release(event: CompRelease, ctx: Context) -> None:
        calls.append(ctx.compensates)

    with caplog.at_level(logging.WARNING, logger="eventflow.consumer"):
        async with App("comp-nodedup", broker=broker_url, handlers=[release]) as app:
            for n in range(2):
                await app.publish(
                    CompRelease(order_id=f"n{n}"), headers={COMPENSATES_HEADER: f"c{n}"}
                )
            await waiter(lambda: len(calls) == 2)
            assert _stats(app, "nodedup", "it.comp.release")["cancels"] == 0
    assert calls == ["c0", "c1"]
    warned = [r for r in caplog.records if "idempotent=False" in r.getMessage()]
    assert len(warned) == 1


async def test_a_compensation_header_that_names_no_command_is_dead_lettered(
    broker_url: str, waiter: Wait
) -> None:
    """An empty header, or one naming the compensation itself, is bad input: dead-lettered
    at once (reason ``malformed``), the handler not called, nothing cancelled."""
    calls: list[str] = []

    @subscribe("it.comp.release", group="bad")
    async def release(event: CompRelease) -> None:
        calls.append(event.order_id)

    async with App("comp-bad", broker=broker_url, handlers=[release]) as app:
        own = new_id()
        await app.publish(
            envelope_for(
                CompRelease(order_id="self"), source="t", id=own, headers={COMPENSATES_HEADER: own}
            )
        )
        await app.publish(CompRelease(order_id="empty"), headers={COMPENSATES_HEADER: ""})
        await app.publish(CompRelease(order_id="plain"))  # the control: no header, handled
        await waiter(lambda: _settled(app, "bad", "it.comp.release") == 3)
        assert calls == ["plain"]
        letters = await app.dead_letters.list()
        assert sorted(d.reason for d in letters) == ["malformed", "malformed"]
        assert all(COMPENSATES_HEADER in d.error for d in letters)
        assert _stats(app, "bad", "it.comp.release")["cancels"] == 0


async def test_the_header_survives_a_dead_letter_and_its_replay(
    broker_url: str, waiter: Wait
) -> None:
    """A compensation whose handler fails is dead-lettered; its replay carries the header
    (it is in the envelope): ctx.compensates still names the command."""
    group = f"inv{uuid.uuid4().hex[:8]}"
    seen: list[str | None] = []
    fail = [True]

    @subscribe("it.comp.reserve", group=group)
    async def reserve(event: CompReserve) -> None:
        pass

    @subscribe("it.comp.release", group=group, retry=1)
    async def release(event: CompRelease, ctx: Context) -> None:
        seen.append(ctx.compensates)
        if fail[0]:
            raise RuntimeError("the stock service is down")

    async with App("comp-replay", broker=broker_url, handlers=[reserve, release]) as app:
        command = await app.publish(CompReserve(order_id="d"), key="d")
        await waiter(lambda: _stats(app, group, "it.comp.reserve")["handled"] == 1)
        await app.publish(
            CompRelease(order_id="d"), key="d", headers={COMPENSATES_HEADER: command.id}
        )
        await waiter(lambda: _stats(app, group, "it.comp.release")["dead_lettered"] == 1)
        [letter] = await app.dead_letters.list()
        fail[0] = False
        await app.dead_letters.replay([letter.id])
        await waiter(lambda: _stats(app, group, "it.comp.release")["handled"] == 1)
    assert seen == [command.id, command.id]


# -- the decision, on every dedup store --------------------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "postgres", "redis"])
async def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Store, DedupStore]]:
    """A store and the dedup store an app would use with it: its own table, or Redis apart
    from a memory store (``App(dedup="redis://...")``)."""
    kind = request.param
    if kind == "redis":
        store: Store = MemoryStore()
        dedup = dedup_for(f"{redis_url()}?prefix=t{uuid.uuid4().hex}&retention=60")
        await dedup.open()
        yield store, dedup
        await dedup.close()
        return
    if kind == "postgres":
        async with isolated_schema(postgres_url()) as url:
            store = store_for(url)
            await store.open()
            yield store, store.dedup
            await store.close()
        return
    store = MemoryStore() if kind == "memory" else store_for(f"sqlite:///{tmp_path / 'd.db'}")
    await store.open()
    yield store, store.dedup
    await store.close()


async def test_what_a_compensations_arrival_decides(stores: tuple[Store, DedupStore]) -> None:
    """Not handled: cancelled (both recorded). Again: a duplicate. Another compensation of
    the cancelled command: nothing to undo (recorded). A handled command: undo (nothing
    recorded). A cancellation recorded without its compensation (a stop between Redis's two
    records): the next delivery completes it."""
    store, dedup = stores
    group, command, first, second = "inv", new_id(), new_id(), new_id()
    assert await decide(store, dedup, group, first, command) is Decision.CANCELLED
    assert await dedup.seen(group, command) and await dedup.seen(group, first)
    assert await dedup.cancelled_by(group, command) == first
    assert await decide(store, dedup, group, first, command) is Decision.DUPLICATE
    assert await decide(store, dedup, group, second, command) is Decision.NOTHING_TO_UNDO
    assert await dedup.seen(group, second)
    assert await dedup.cancelled_by(group, command) == first

    handled, undo = new_id(), new_id()
    await dedup.mark(group, handled)
    assert await decide(store, dedup, group, undo, handled) is Decision.UNDO
    assert not await dedup.seen(group, undo)  # the handler's success records it
    assert await decide(store, dedup, "other-group", undo, handled) is Decision.CANCELLED

    halfway, resumed = new_id(), new_id()
    assert await dedup.mark_new(group, halfway, cancelled_by=resumed)
    assert await decide(store, dedup, group, resumed, halfway) is Decision.CANCELLED
    assert await dedup.seen(group, resumed)
