"""Dead-letter replays on real brokers: a replay reaches the handler even within the
broker's duplicate window of the original publish (JetStream's ``Nats-Msg-Id`` window is
2 minutes), from code (``app.dead_letters.replay``) and from ``eventflow dlq replay``, and a
letter whose copy the broker did not accept is kept.

The NATS and Kafka servers come from ``eventflow.testing`` (bundled binaries, a URL from the
environment or testcontainers); without one these tests skip, or fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest

from eventflow import App, BackpressureError, Context, Event, subscribe
from eventflow.cli import main
from eventflow.testing.broker_contract import eventually, unique_name


class ReplayJob(Event, type="it.replay.job"):
    """A job whose handler fails until it is told to work."""

    n: int


@pytest.fixture(params=["memory", "nats", "kafka"])
def broker_url(request: pytest.FixtureRequest) -> str:
    """A broker URL of each kind, on a stream (NATS) of its own."""
    if request.param == "memory":
        return f"memory://{unique_name('hub')}"
    if request.param == "nats":
        url: str = request.getfixturevalue("nats_url")
        return f"{url}?stream={unique_name('EF').upper()}&storage=memory"
    url = request.getfixturevalue("kafka_url")
    return str(url)


class _Worker:
    """A handler in a group of its own that fails (one attempt, then a dead letter) until
    ``working`` is set."""

    def __init__(self) -> None:
        self.working = False
        self.handled: list[tuple[str, int]] = []
        self.group = unique_name("workers")

        @subscribe("it.replay.job", group=self.group, retry=1)
        async def work(event: ReplayJob, ctx: Context) -> None:
            if not self.working:
                raise RuntimeError(f"job {event.n} cannot run yet")
            self.handled.append((ctx.envelope.id, event.n))

        self.handler = work


@dataclass(frozen=True)
class _Letter:
    """Job ``n`` of ``app``, dead-lettered: its envelope's id and its letter's."""

    app: App
    worker: _Worker
    n: int
    envelope_id: str
    id: str

    async def handled_once(self) -> None:
        """The replay was handled, with the original envelope id, and no letter is left."""
        worker = self.worker
        await eventually(lambda: worker.handled, timeout=30, message="the replay handled")
        assert worker.handled == [(self.envelope_id, self.n)]
        assert await self.app.dead_letters.list() == []


@asynccontextmanager
async def _dead_lettered(name: str, broker: str, store: str, n: int) -> AsyncIterator[_Letter]:
    """An app ``name`` whose job ``n`` was dead-lettered (its only letter), its worker
    working now."""
    worker = _Worker()
    async with App(name, broker=broker, store=store, handlers=[worker.handler]) as app:
        env = await app.publish(ReplayJob(n=n), key=f"job-{n}")

        async def one() -> bool:
            return len(await app.dead_letters.list()) == 1

        await eventually(one, timeout=30, message="the job dead-lettered")
        [letter] = await app.dead_letters.list()
        worker.working = True
        yield _Letter(app, worker, n, env.id, letter.id)


async def test_a_replay_within_the_duplicate_window_reaches_the_handler(
    broker_url: str, tmp_path: Path
) -> None:
    """Published, dead-lettered and replayed within seconds (well inside JetStream's 2-minute
    window): the replayed copy is handled, with the original envelope id, and the letter is
    gone."""
    store = f"sqlite:///{tmp_path / 'replay.db'}"
    async with _dead_lettered("replay-it", broker_url, store, 1) as letter:
        assert await letter.app.dead_letters.replay([letter.id]) == 1
        await letter.handled_once()


async def test_the_cli_replay_within_the_duplicate_window_reaches_the_handler(
    nats_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``eventflow dlq replay ID --store URL --broker nats://...`` from another process's
    point of view (its own store and broker connections), seconds after the publish."""
    broker = f"{nats_url}?stream={unique_name('EF').upper()}&storage=memory"
    store = f"sqlite:///{tmp_path / 'replay.db'}"
    async with _dead_lettered("replay-cli", broker, store, 2) as letter:
        code = await asyncio.to_thread(
            main, ["dlq", "replay", letter.id, "--store", store, "--broker", broker]
        )
        assert code == 0
        assert "replayed 1 dead letter" in capsys.readouterr().out
        await letter.handled_once()


async def test_a_letter_whose_copy_the_broker_refuses_is_kept(
    nats_url: str, tmp_path: Path
) -> None:
    """A stream that is full (``max_msgs=1``, holding the original): the replay raises and
    the letter stays, to be replayed once there is room. (When the replay reused the
    envelope id as ``Nats-Msg-Id``, JetStream answered "duplicate" even here, and the letter
    was deleted with its message lost.)"""
    stream = unique_name("EF").upper()
    broker = f"{nats_url}?stream={stream}&storage=memory&max_msgs=1&publish_timeout=0.5"
    store = f"sqlite:///{tmp_path / 'replay.db'}"
    async with _dead_lettered("replay-full", broker, store, 3) as letter:
        with pytest.raises(BackpressureError, match="full"):
            await letter.app.dead_letters.replay([letter.id])
        assert [d.id for d in await letter.app.dead_letters.list()] == [letter.id]
        assert letter.worker.handled == []

        nc = await nats.connect(nats_url)
        try:
            await nc.jetstream().purge_stream(stream)  # room again
        finally:
            await nc.close()
        assert await letter.app.dead_letters.replay([letter.id]) == 1
        await letter.handled_once()
