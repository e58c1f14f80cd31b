"""Failure classes of DESIGN section 9 on every broker (memory, NATS, Kafka/Tansu):
``Reject`` and ``give_up_on`` dead-letter after one attempt with reason ``rejected`` while
other exceptions are still retried; ``RetryLater(after=)`` has the broker hold the message
while the subscription's other keys flow (also against an HTTP server on loopback that
answers 429 with ``Retry-After``: ``loopback_http.py``); ``ctx.idempotency_key`` stays the
same across the attempts and the dead-letter replay of one message.

The NATS and Kafka servers come from ``eventflow.testing``; without one these tests skip,
or fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from loopback_http import Reply, post, serving

from eventflow import App, Context, Event, Reject, RetryLater, RetryPolicy, subscribe
from eventflow.cli import main
from eventflow.context import idempotency_key
from eventflow.testing.broker_contract import eventually, unique_name


class FcOrder(Event, type="it.fc.order"):
    """An order line; ``sku`` says how the handler fails."""

    n: int
    sku: str


@pytest.fixture(
    params=[
        "memory",
        pytest.param("nats", marks=pytest.mark.service("nats")),
        pytest.param("kafka", marks=pytest.mark.service("kafka")),
    ]
)
def broker_url(request: pytest.FixtureRequest) -> str:
    """A broker URL of each kind, on a hub, a stream (NATS) or topics (Kafka) of its own."""
    if request.param == "memory":
        return f"memory://{unique_name('hub')}"
    if request.param == "nats":
        url: str = request.getfixturevalue("nats_url")
        return f"{url}?stream={unique_name('FC').upper()}&storage=memory"
    url = request.getfixturevalue("kafka_url")
    return f"{url}&topic_prefix={unique_name('fc')}."  # topics of the test's own


def _fast(attempts: int) -> RetryPolicy:
    return RetryPolicy(max_attempts=attempts, initial_delay=0.01, max_delay=0.05)


async def test_reject_and_give_up_on_dead_letter_after_one_attempt(
    broker_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Reject`` and a ``give_up_on`` type: one attempt, reason ``rejected`` with the text;
    a RuntimeError beside them (the positive control) still gets its three attempts and is
    filed as ``handler-failed``; ``eventflow dlq list`` shows the reasons."""
    calls: dict[str, list[int]] = {}
    group = unique_name("stock")

    @subscribe("it.fc.order", group=group, retry=_fast(3), give_up_on=(ValueError,))
    async def reserve(event: FcOrder, ctx: Context) -> None:
        calls.setdefault(event.sku, []).append(ctx.attempt)
        if event.sku == "sku-a":
            raise Reject("sku-a is discontinued")
        if event.sku == "sku-b":
            raise ValueError("not enough sku-b")
        raise RuntimeError("the warehouse is down")

    store = f"sqlite:///{tmp_path / 'fc.db'}"
    async with App("fc-reject", broker=broker_url, store=store, handlers=[reserve]) as app:
        for n, sku in enumerate(("sku-a", "sku-b", "sku-c")):
            await app.publish(FcOrder(n=n, sku=sku), key=f"o-{n}")

        async def three() -> bool:
            return len(await app.dead_letters.list()) == 3

        await eventually(three, timeout=30, message="three dead letters")
        letters = {letter.key: letter for letter in await app.dead_letters.list()}
        stats = app.stats()[f"{group}:it.fc.order"]

    assert calls == {"sku-a": [1], "sku-b": [1], "sku-c": [1, 2, 3]}
    rejected, given_up, failed = letters["o-0"], letters["o-1"], letters["o-2"]
    assert (rejected.reason, rejected.attempts) == ("rejected", 1)
    assert rejected.error.startswith("Reject: sku-a is discontinued")
    assert (given_up.reason, given_up.attempts) == ("rejected", 1)
    assert given_up.error.startswith("ValueError: not enough sku-b")
    assert (failed.reason, failed.attempts) == ("handler-failed", 3)
    assert stats["retries"] == 2  # only sku-c's

    assert await asyncio.to_thread(main, ["dlq", "list", "--store", store, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count('"rejected"') == 2
    assert out.count('"handler-failed"') == 1


async def test_retry_later_waits_in_the_broker_while_other_keys_flow(broker_url: str) -> None:
    """One worker (``concurrency=1``): a handler that asks for ``RetryLater(after=3)`` does
    not hold it. The 20 orders of other keys published behind it are handled before its
    second attempt, which starts no sooner than 3 s after the first failed; the key's own
    later order waits for it (key order); the attempt counted."""
    after = 3.0
    events: list[tuple[str, int, int]] = []  # (key, n, attempt)
    failed_at: list[float] = []
    retried_at: list[float] = []
    group = unique_name("pay")

    @subscribe("it.fc.order", group=group, retry=3)
    async def charge(event: FcOrder, ctx: Context) -> None:
        key = ctx.envelope.key or ""
        if event.sku == "busy" and ctx.attempt == 1:
            failed_at.append(time.monotonic())
            raise RetryLater(after=after, reason="the provider answered 429")
        if event.sku == "busy":
            retried_at.append(time.monotonic())
        events.append((key, event.n, ctx.attempt))

    async with App("fc-later", broker=broker_url, handlers=[charge]) as app:
        await app.publish(FcOrder(n=0, sku="busy"), key="slow")
        await eventually(lambda: failed_at, timeout=30, message="the first attempt")
        await app.publish(FcOrder(n=1, sku="plain"), key="slow")
        for n in range(2, 22):
            await app.publish(FcOrder(n=n, sku="plain"), key=f"k-{n}")
        await eventually(lambda: len(events) == 22, timeout=60, message="every order")
        stats = app.stats()[f"{group}:it.fc.order"]

    slow = [e for e in events if e[0] == "slow"]
    assert slow == [("slow", 0, 2), ("slow", 1, 1)]  # the retry, then the key's next order
    first_slow = events.index(("slow", 0, 2))
    assert sorted(n for _, n, _ in events[:first_slow]) == list(range(2, 22))
    assert retried_at[0] - failed_at[0] >= after - 0.05  # the broker kept the delay
    assert stats["retries"] == 1
    assert stats["dead_lettered"] == 0


async def test_a_providers_retry_after_is_honoured_while_other_keys_are_served(
    broker_url: str,
) -> None:
    """Against an HTTP server on loopback: the first charge of order ``slow`` is answered
    ``429`` with ``Retry-After: 2`` and the handler raises ``RetryLater`` with it. The
    server sees that order's next request no sooner than 2 s after it answered, and the
    other orders' requests (published behind it, one worker) in between."""
    answered: list[float] = []

    def respond(path: str, n: int) -> Reply:
        if path == "/charges/slow" and n == 0:
            answered.append(time.monotonic())
            return Reply(429, {"Retry-After": "2"})
        return Reply(200)

    group = unique_name("pay")
    async with serving(respond, max_requests=100) as server:

        @subscribe("it.fc.order", group=group, retry=3)
        async def charge(event: FcOrder, ctx: Context) -> None:
            status, headers = await post(
                server.port,
                f"/charges/{ctx.envelope.key}",
                headers={"Idempotency-Key": ctx.idempotency_key},
            )
            if status == 429:
                raise RetryLater(after=float(headers["retry-after"]), reason="HTTP 429")
            assert status == 200, status

        async with App("fc-http", broker=broker_url, handlers=[charge]) as app:
            await app.publish(FcOrder(n=0, sku="busy"), key="slow")
            await eventually(lambda: answered, timeout=30, message="the 429")
            for n in range(1, 11):
                await app.publish(FcOrder(n=n, sku="plain"), key=f"k-{n}")
            await eventually(
                lambda: len(server.requests) == 12, timeout=60, message="every request"
            )
            stats = app.stats()[f"{group}:it.fc.order"]

    paths = server.paths()
    assert paths[0] == paths[-1] == "/charges/slow"
    assert sorted(paths[1:-1]) == sorted(f"/charges/k-{n}" for n in range(1, 11))
    assert server.requests[-1].at - answered[0] >= 2.0 - 0.05
    slow_keys = [r.headers["idempotency-key"] for r in server.requests if r.path.endswith("slow")]
    assert len(slow_keys) == 2 and slow_keys[0] == slow_keys[1]  # the provider sees one request
    assert stats["retries"] == 1


async def test_retry_later_out_of_attempts_is_dead_lettered(broker_url: str) -> None:
    """``RetryLater`` spends attempts: with ``retry=2`` the second one is the last, and the
    message is dead-lettered as a handler failure."""
    attempts: list[int] = []
    group = unique_name("later")

    @subscribe("it.fc.order", group=group, retry=2)
    async def charge(event: FcOrder, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        raise RetryLater(after=0.2)

    async with App("fc-later-dlq", broker=broker_url, handlers=[charge]) as app:
        await app.publish(FcOrder(n=1, sku="busy"), key="o-1")

        async def one() -> bool:
            return len(await app.dead_letters.list()) == 1

        await eventually(one, timeout=30, message="the dead letter")
        [letter] = await app.dead_letters.list()

    assert attempts == [1, 2]
    assert (letter.reason, letter.attempts) == ("handler-failed", 2)
    assert "RetryLater" in letter.error


async def test_idempotency_key_is_stable_across_attempts_and_a_replay(
    broker_url: str, tmp_path: Path
) -> None:
    """One message: the same key at attempt 1, at attempt 2 and in its dead-letter replay;
    another message and another group get other keys."""
    seen: dict[str, list[tuple[str, int, str]]] = {"a": [], "b": []}
    working = False
    group_a, group_b = unique_name("billing"), unique_name("audit")

    @subscribe("it.fc.order", group=group_a, retry=_fast(2))
    async def bill(event: FcOrder, ctx: Context) -> None:
        seen["a"].append((event.sku, ctx.attempt, ctx.idempotency_key))
        if event.sku == "x" and not working:
            raise RuntimeError("the provider is down")

    @subscribe("it.fc.order", group=group_b)
    async def audit(event: FcOrder, ctx: Context) -> None:
        seen["b"].append((event.sku, ctx.attempt, ctx.idempotency_key))

    store = f"sqlite:///{tmp_path / 'keys.db'}"
    async with App("fc-keys", broker=broker_url, store=store, handlers=[bill, audit]) as app:
        x = await app.publish(FcOrder(n=1, sku="x"), key="o-1")
        y = await app.publish(FcOrder(n=2, sku="y"), key="o-2")

        async def letter() -> bool:
            return len(await app.dead_letters.list()) == 1

        await eventually(letter, timeout=30, message="x dead-lettered")
        await eventually(lambda: len(seen["b"]) == 2, timeout=30, message="both audited")
        working = True
        [dead] = await app.dead_letters.list()
        assert await app.dead_letters.replay([dead.id]) == 1
        await eventually(lambda: len(seen["a"]) == 4, timeout=30, message="the replay")

    key_x = idempotency_key(group_a, x.id)
    assert [k for sku, _, k in seen["a"] if sku == "x"] == [key_x, key_x, key_x]
    assert [a for sku, a, _ in seen["a"] if sku == "x"] == [1, 2, 1]
    assert [k for sku, _, k in seen["a"] if sku == "y"] == [idempotency_key(group_a, y.id)]
    keys_b = {sku: k for sku, _, k in seen["b"]}
    assert keys_b == {"x": idempotency_key(group_b, x.id), "y": idempotency_key(group_b, y.id)}
    assert len({key_x, *keys_b.values(), idempotency_key(group_a, y.id)}) == 4


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_retry_later_redeliveries_are_no_crash_loop(
    store: str, tmp_path: Path, broker_name: str
) -> None:
    """Eight ``RetryLater`` give-backs with ``max_deliveries=3``: each redelivery is the
    consumer's own, not a crash's, so the message runs out of attempts (``handler-failed``,
    8 attempts) rather than being taken for a crash loop; with the memory store (the
    broker's delivery count) and with SQLite (durable attempt records) alike."""
    attempts: list[int] = []

    @subscribe("it.fc.order", group="later-loop", retry=8, max_deliveries=3)
    async def charge(event: FcOrder, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        raise RetryLater(after=0.01)

    url = "memory://" if store == "memory" else f"sqlite:///{tmp_path / 'loop.db'}"
    async with App(
        "fc-later-loop", broker=f"memory://{broker_name}", store=url, handlers=[charge]
    ) as app:
        await app.publish(FcOrder(n=1, sku="busy"), key="o-1")

        async def one() -> bool:
            return len(await app.dead_letters.list()) == 1

        await eventually(one, timeout=30, message="the dead letter")
        [letter] = await app.dead_letters.list()

    assert attempts == list(range(1, 9))
    assert (letter.reason, letter.attempts) == ("handler-failed", 8)
