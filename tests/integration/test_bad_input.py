"""Bad input is dead-lettered at once, never retried, and does not stop the consumer;
dead letters can be listed, replayed to the failed group only, and purged."""

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest

from eventflow import (
    App,
    Context,
    DeadLetter,
    DeadLetterNotFound,
    Envelope,
    Event,
    RetryPolicy,
    subscribe,
    upcaster,
)

Wait = Callable[..., Awaitable[None]]
TOPIC = "it.bad.item"


class Item(Event, type="it.bad.item", version=2):
    name: str
    qty: int


@upcaster("it.bad.item", from_version=1)
def _v1_to_v2(data: dict) -> dict:
    if "explode" in data:
        raise ValueError("cannot upcast an exploding item")
    return {"name": data["title"], "qty": 1}


class Orphan(Event, type="it.bad.orphan"):
    """Known to the registry, but not accepted by the handler below."""

    x: int


def good(n: int) -> bytes:
    return Envelope.create(TOPIC, {"name": f"good-{n}", "qty": n}, version=2, key="k").to_bytes()


BAD_INPUTS = [
    pytest.param(b"\x00\x01 not json", "malformed", "MalformedMessageError", id="not-json"),
    pytest.param(b"[1, 2, 3]", "malformed", "JSON list", id="json-array"),
    pytest.param(b'{"type": "it.bad.item"}', "malformed", "'id'", id="missing-id"),
    pytest.param(
        orjson.dumps({"id": "x-1", "type": TOPIC, "version": "two"}),
        "malformed",
        "'version'",
        id="bad-version-field",
    ),
    pytest.param(
        Envelope.create("it.bad.never-defined", {"a": 1}).to_bytes(),
        "unknown-type",
        "it.bad.never-defined",
        id="unknown-type",
    ),
    pytest.param(
        Envelope.create("it.bad.orphan", {"x": 1}).to_bytes(),
        "unknown-type",
        "does not accept 'it.bad.orphan'",
        id="type-not-accepted",
    ),
    pytest.param(
        Envelope.create(TOPIC, {"name": "n", "qty": 1}, version=3).to_bytes(),
        "future-version",
        "v3",
        id="future-version",
    ),
    pytest.param(
        Envelope.create(TOPIC, {"name": "n", "qty": "lots"}, version=2).to_bytes(),
        "invalid-payload",
        "qty",
        id="invalid-payload",
    ),
    pytest.param(
        Envelope.create(TOPIC, {"name": "n"}, version=2).to_bytes(),
        "invalid-payload",
        "qty",
        id="missing-field",
    ),
    pytest.param(
        Envelope.create(TOPIC, {"explode": True}, version=1).to_bytes(),
        "upcast-failed",
        "cannot upcast",
        id="upcaster-raises",
    ),
]


def item_handler(group: str, calls: list[Item], attempts: list[int]) -> object:
    async def handle(event: Item, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        calls.append(event)

    handle.__qualname__ = f"handle_{group}"
    return subscribe("it.bad.>", group=group, retry=5)(handle)


@pytest.mark.parametrize(("payload", "reason", "text"), BAD_INPUTS)
async def test_bad_input_is_dead_lettered_at_once_and_the_consumer_goes_on(
    payload: bytes, reason: str, text: str, broker_url: str, waiter: Wait
) -> None:
    calls: list[Item] = []
    attempts: list[int] = []
    handler = item_handler("bad-input", calls, attempts)
    async with App("it-bad", broker=broker_url, handlers=[handler]) as app:
        await app.publish(Item(name="before", qty=1), key="k")
        await app.broker.publish(TOPIC, payload, key="k", headers={"x-origin": "test"})
        await app.broker.publish(TOPIC, good(2), key="k")
        await app.publish(Item(name="after", qty=3), key="k")
        await waiter(lambda: len(calls) == 3, what="the good messages")
        letters = await app.dead_letters.list()
        stats = app.stats()["bad-input:it.bad.>"]

    assert [c.name for c in calls] == ["before", "good-2", "after"]
    assert attempts == [1, 1, 1]
    assert len(letters) == 1
    letter = letters[0]
    assert isinstance(letter, DeadLetter)
    assert letter.payload == payload  # the original bytes, untouched
    assert letter.reason == reason
    assert text in letter.error
    assert letter.attempts == 0  # never retried, handler never called
    assert letter.group == "bad-input"
    assert letter.topic == TOPIC
    assert letter.key == "k"
    assert letter.headers.get("x-origin") == "test"
    assert letter.failed_at.utcoffset() is not None
    assert stats["dead_lettered"] == 1
    assert stats["retries"] == 0
    assert stats["handled"] == 3


async def test_old_version_is_upcast_not_dead_lettered(broker_url: str, waiter: Wait) -> None:
    calls: list[Item] = []
    handler = item_handler("upcasting", calls, [])
    async with App("it-bad-upcast", broker=broker_url, handlers=[handler]) as app:
        v1 = Envelope.create(TOPIC, {"title": "legacy"}, version=1)
        await app.broker.publish(TOPIC, v1.to_bytes())
        await waiter(lambda: len(calls) == 1)
        assert await app.dead_letters.list() == []
    assert calls == [Item(name="legacy", qty=1)]


async def test_a_stream_of_garbage_never_stops_the_consumer(broker_url: str, waiter: Wait) -> None:
    calls: list[Item] = []
    handler = item_handler("garbage", calls, [])
    payloads = [p.values[0] for p in BAD_INPUTS]
    async with App("it-bad-stream", broker=broker_url, handlers=[handler]) as app:
        for round_ in range(5):
            for payload in payloads:
                await app.broker.publish(TOPIC, payload)
            await app.broker.publish(TOPIC, good(round_))
        await waiter(lambda: len(calls) == 5)
        await waiter(lambda: app.stats()["garbage:it.bad.>"]["dead_lettered"] == 5 * len(payloads))
        letters = await app.dead_letters.list(limit=1000)
    assert sorted(c.qty for c in calls) == [0, 1, 2, 3, 4]
    assert len(letters) == 5 * len(payloads)
    assert all(letter.attempts == 0 for letter in letters)
    assert sorted({letter.reason for letter in letters}) == sorted(
        {"malformed", "unknown-type", "future-version", "invalid-payload", "upcast-failed"}
    )


async def test_raw_envelope_handlers_still_reject_undecodable_bytes(
    broker_url: str, waiter: Wait
) -> None:
    got: list[Envelope] = []

    @subscribe("it.bad.>", group="raw")
    async def handle(env: Envelope) -> None:
        got.append(env)

    async with App("it-bad-raw", broker=broker_url, handlers=[handle]) as app:
        await app.broker.publish(TOPIC, b"{{{")
        unknown = Envelope.create("it.bad.whatever", {"free": "form"})
        await app.broker.publish("it.bad.whatever", unknown.to_bytes())
        await waiter(lambda: len(got) == 1)
        await waiter(lambda: app.stats()["raw:it.bad.>"]["dead_lettered"] == 1)
        (letter,) = await app.dead_letters.list()
    assert got == [unknown]  # a raw handler takes any type
    assert letter.reason == "malformed"


# -- replay and purge --------------------------------------------------------------------------


async def test_replay_redelivers_to_the_failed_group_only(broker_url: str, waiter: Wait) -> None:
    allow = asyncio.Event()
    fussy_calls: list[str] = []
    other_calls: list[str] = []

    @subscribe(TOPIC, group="fussy", retry=RetryPolicy(max_attempts=1))
    async def fussy(event: Item, ctx: Context) -> None:
        fussy_calls.append(ctx.envelope.id)
        if not allow.is_set():
            raise RuntimeError("not today")

    @subscribe(TOPIC, group="relaxed", idempotent=False)  # would see a broadcast replay twice
    async def relaxed(event: Item, ctx: Context) -> None:
        other_calls.append(ctx.envelope.id)

    async with App("it-bad-replay", broker=broker_url, handlers=[fussy, relaxed]) as app:
        env = await app.publish(Item(name="x", qty=1), key="k")
        await waiter(lambda: app.stats()[f"fussy:{TOPIC}"]["dead_lettered"] == 1)
        await waiter(lambda: other_calls == [env.id])
        (letter,) = await app.dead_letters.list()
        assert letter.group == "fussy"
        assert letter.attempts == 1
        assert "not today" in letter.error
        assert (await app.dead_letters.get(letter.id)) == letter
        assert await app.dead_letters.count() == {"fussy": 1}

        allow.set()
        assert await app.dead_letters.replay([letter.id]) == 1
        await waiter(lambda: app.stats()[f"fussy:{TOPIC}"]["handled"] == 1, what="replayed")
        # A marker on the same key: once "relaxed" has it, it has seen the replay too.
        marker = await app.publish(Item(name="marker", qty=2), key="k")
        await waiter(lambda: marker.id in other_calls)
        assert await app.dead_letters.list() == []
        with pytest.raises(DeadLetterNotFound):
            await app.dead_letters.get(letter.id)

    assert fussy_calls == [env.id, env.id, marker.id]
    assert other_calls == [env.id, marker.id]  # the replay did not reach the other group


async def test_replayed_bad_input_fails_again_with_the_same_bytes(
    broker_url: str, waiter: Wait
) -> None:
    handler = item_handler("replay-bad", [], [])
    async with App("it-bad-replay2", broker=broker_url, handlers=[handler]) as app:
        await app.broker.publish(TOPIC, b"garbage")
        await waiter(lambda: app.stats()["replay-bad:it.bad.>"]["dead_lettered"] == 1)
        (first,) = await app.dead_letters.list()
        await app.dead_letters.replay([first.id])
        await waiter(lambda: app.stats()["replay-bad:it.bad.>"]["dead_lettered"] == 2)
        (second,) = await app.dead_letters.list()
    assert second.id != first.id
    assert second.payload == first.payload == b"garbage"
    assert second.headers == first.headers  # the replay's own headers are not kept


async def test_purge_deletes_and_bad_ids_raise(broker_url: str, waiter: Wait) -> None:
    handler = item_handler("purge", [], [])
    async with App("it-bad-purge", broker=broker_url, handlers=[handler]) as app:
        for n in range(3):
            await app.broker.publish(TOPIC, f"garbage-{n}".encode())
        await waiter(lambda: app.stats()["purge:it.bad.>"]["dead_lettered"] == 3)
        letters = await app.dead_letters.list()
        assert [d.payload for d in letters] == [b"garbage-0", b"garbage-1", b"garbage-2"]

        assert await app.dead_letters.purge([letters[0].id]) == 1
        remaining = await app.dead_letters.list()
        assert [d.id for d in remaining] == [letters[1].id, letters[2].id]
        with pytest.raises(DeadLetterNotFound, match="dlq list"):
            await app.dead_letters.get(letters[0].id)
        with pytest.raises(DeadLetterNotFound):
            await app.dead_letters.purge([letters[0].id])
        with pytest.raises(DeadLetterNotFound):
            await app.dead_letters.purge(["no-such-letter"])
        with pytest.raises(DeadLetterNotFound):
            await app.dead_letters.replay(["no-such-letter"])
        assert len(await app.dead_letters.list()) == 2  # a failed call changed nothing

        assert await app.dead_letters.purge() == 2
        assert await app.dead_letters.list() == []
        assert await app.dead_letters.count() == {}


async def test_dead_letters_list_by_group_and_limit(broker_url: str, waiter: Wait) -> None:
    a = item_handler("group-a", [], [])
    b = item_handler("group-b", [], [])
    async with App("it-bad-groups", broker=broker_url, handlers=[a, b]) as app:
        for n in range(4):
            await app.broker.publish(TOPIC, f"junk-{n}".encode())
        await waiter(lambda: sum(s["dead_lettered"] for s in app.stats().values()) == 8)
        assert len(await app.dead_letters.list()) == 8
        assert len(await app.dead_letters.list(limit=3)) == 3
        only_a = await app.dead_letters.list(group="group-a")
        assert {d.group for d in only_a} == {"group-a"} and len(only_a) == 4
        assert await app.dead_letters.count() == {"group-a": 4, "group-b": 4}


async def test_list_finds_this_apps_letters_in_a_shared_store(
    tmp_path: Path, broker_url: str, waiter: Wait
) -> None:
    store = f"sqlite:///{tmp_path}/shared.db"
    noisy = item_handler("noisy", [], [])
    quiet = item_handler("quiet", [], [])
    async with App("it-bad-noisy", broker=broker_url, store=store, handlers=[noisy]) as app:
        for n in range(20):
            await app.broker.publish(TOPIC, f"noise-{n}".encode())
        await waiter(lambda: app.stats()["noisy:it.bad.>"]["dead_lettered"] == 20)
    async with App("it-bad-quiet", broker=broker_url, store=store, handlers=[quiet]) as app:
        await app.broker.publish(TOPIC, b"mine")
        await waiter(lambda: app.stats()["quiet:it.bad.>"]["dead_lettered"] == 1)
        assert await app.dead_letters.count() == {"quiet": 1}
        letters = await app.dead_letters.list(limit=1)
    assert [d.payload for d in letters] == [b"mine"]


async def test_apps_sharing_a_store_see_only_their_own_letters(
    tmp_path: Path, broker_url: str, waiter: Wait
) -> None:
    store = f"sqlite:///{tmp_path}/shared.db"
    one = item_handler("one", [], [])
    two = item_handler("two", [], [])
    app1 = App("it-bad-one", broker=broker_url, store=store, handlers=[one])
    app2 = App("it-bad-two", broker=broker_url, store=store, handlers=[two])
    async with app1, app2:
        await app1.broker.publish(TOPIC, b"junk")  # both groups get it
        await waiter(lambda: app1.stats()["one:it.bad.>"]["dead_lettered"] == 1)
        await waiter(lambda: app2.stats()["two:it.bad.>"]["dead_lettered"] == 1)
        (mine,) = await app1.dead_letters.list()
        (theirs,) = await app2.dead_letters.list()
        assert (mine.group, theirs.group) == ("one", "two")
        with pytest.raises(DeadLetterNotFound):
            await app1.dead_letters.get(theirs.id)
        with pytest.raises(DeadLetterNotFound):
            await app1.dead_letters.purge([theirs.id])
        assert await app1.dead_letters.purge() == 1
        assert await app2.dead_letters.list() == [theirs]
