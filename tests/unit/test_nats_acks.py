"""JetStream PubAcks with many publishes in flight (``eventflow/adapters/nats/acks.py``):
each publish gets its own answer, a publish nobody answers fails at its own deadline (a
shorter one first, even behind longer ones), no stream on the subject is
``NoRespondersError``, and closing fails whatever still waits."""

from __future__ import annotations

import asyncio
import uuid

import nats
import orjson
import pytest
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.js.api import StreamConfig

from eventflow.adapters.nats.acks import PubAcks


async def test_each_publish_gets_its_own_puback(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    stream = f"ACKS_{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream}.>"]))
    acks = PubAcks(nc)
    await acks.start()
    try:
        answers = await asyncio.gather(
            *(
                acks.publish(f"{stream}.x", b"m%d" % i, {"Nats-Msg-Id": f"id-{i}"}, 5.0)
                for i in range(300)
            )
        )
        seqs = [orjson.loads(a)["seq"] for a in answers]
        assert seqs == list(range(1, 301))  # stored in call order, each answer its own
        again = orjson.loads(await acks.publish(f"{stream}.x", b"m0", {"Nats-Msg-Id": "id-0"}, 5.0))
        assert again["duplicate"] is True and again["seq"] == 1
    finally:
        await acks.close()
        await js.delete_stream(stream)
        await nc.close()


async def test_unanswered_publishes_fail_at_their_own_deadlines(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subject = f"silent.{uuid.uuid4().hex[:8]}"
    heard: list[str] = []

    async def silent(msg: nats.aio.msg.Msg) -> None:  # receives, never answers
        heard.append(msg.reply)

    await nc.subscribe(subject, cb=silent)
    acks = PubAcks(nc)
    await acks.start()
    loop = asyncio.get_running_loop()
    ended: dict[str, float] = {}

    async def timed(name: str, timeout: float) -> None:
        began = loop.time()
        with pytest.raises(TimeoutError):
            await acks.publish(subject, b"x", {}, timeout)
        ended[name] = loop.time() - began

    try:
        long = asyncio.create_task(timed("long", 60.0))
        await asyncio.sleep(0.05)
        await timed("short", 0.2)  # behind the long one, due first
        # Not held until the long one's deadline (half of it is a wide margin).
        assert "long" not in ended and ended["short"] < 30.0
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        assert len(heard) == 2
    finally:
        await acks.close()
        await nc.close()


async def test_a_deadline_between_two_waiting_ones_fails_at_its_own(nats_url: str) -> None:
    """A publish due after the oldest waiting one but before the newest (a retry with less
    time left than a first try sent just before it) fails at its own deadline, not at the
    newest one's."""
    nc = await nats.connect(nats_url)
    subject = f"silent.{uuid.uuid4().hex[:8]}"
    await nc.subscribe(subject, cb=_never_answer)
    acks = PubAcks(nc)
    await acks.start()
    loop = asyncio.get_running_loop()
    ended: dict[str, float] = {}

    async def timed(name: str, timeout: float) -> None:
        began = loop.time()
        with pytest.raises(TimeoutError):
            await acks.publish(subject, b"x", {}, timeout)
        ended[name] = loop.time() - began

    try:
        oldest = asyncio.create_task(timed("oldest", 0.2))
        newest = asyncio.create_task(timed("newest", 20.0))
        await asyncio.sleep(0.05)
        await timed("between", 0.5)
        await oldest  # the positive control: the oldest failed at its deadline
        assert "newest" not in ended and ended["between"] < 10.0
        newest.cancel()
        with pytest.raises(asyncio.CancelledError):
            await newest
    finally:
        await acks.close()
        await nc.close()


async def _never_answer(msg: nats.aio.msg.Msg) -> None:
    """A subscriber that receives and never answers."""


async def test_no_stream_is_no_responders_and_close_fails_the_waiting(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    acks = PubAcks(nc)
    await acks.start()
    try:
        with pytest.raises(NoRespondersError):
            await acks.publish(f"nowhere.{uuid.uuid4().hex[:8]}", b"x", {}, 5.0)
        subject = f"silent.{uuid.uuid4().hex[:8]}"
        await nc.subscribe(subject)
        waiting = asyncio.create_task(acks.publish(subject, b"x", {}, 30.0))
        await asyncio.sleep(0.1)
        await acks.close()
        with pytest.raises(ConnectionClosedError):
            await waiting
    finally:
        await acks.close()
        await nc.close()
