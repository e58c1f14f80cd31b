"""``eventflow status`` health from the runtime (issue 22, item 4): an app whose NATS server
is away, or whose projection keeps failing on one event, is ``DEGRADED`` with a problem
line naming the cause and since when, and ``ok`` again after. Both used to say ``ok``.

The NATS server is started here from the bundled binary and killed and restarted to stage
the outage; the store is a SQLite file the command line reads, as a person's would be.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from eventflow import App, Context, Event, subscribe
from eventflow.adapters.nats import NatsBroker
from eventflow.cli import main
from eventflow.projections import Projection, ProjectionContext, lease_name
from eventflow.sourcing.on import on
from eventflow.stores import open_store
from eventflow.testing.broker_contract import unique_name
from eventflow.testing.nats_server import NatsServer, NatsServerUnavailable
from eventflow.testing.services import service_unavailable

Wait = Callable[..., Awaitable[None]]
BEAT = 0.1


class Ping(Event, type="it.health.ping"):
    """A message the health tests' app consumes."""

    n: int


class Tally(Event, type="it.health.tally"):
    """An event the projection counts, or fails on while told to."""

    n: int


class Tallies(Projection, name="it_health_tallies"):
    """Fails on every event while ``broken`` is set."""

    def __init__(self) -> None:
        self.broken = True
        self.seen: list[int] = []

    @on(Tally)
    async def _tally(self, e: Tally, ctx: ProjectionContext) -> None:
        if self.broken:
            raise ValueError(f"tally {e.n} does not add up")
        self.seen.append(e.n)


def _status(url: str, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    """``eventflow status`` as JSON and as text (run in a thread: it has its own loop)."""
    capsys.readouterr()
    assert main(["status", "--store", url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(["status", "--store", url]) == 0
    return data, capsys.readouterr().out


async def _until_status(
    url: str, capsys: pytest.CaptureFixture[str], waiter: Wait, health: str
) -> tuple[dict[str, Any], str]:
    seen: list[tuple[dict[str, Any], str]] = []

    async def check() -> bool:
        seen.append(await asyncio.to_thread(_status, url, capsys))
        (inst,) = seen[-1][0]["instances"]
        return bool(inst["health"] == health)

    await waiter(check, timeout=20, what=f"status {health}")
    return seen[-1]


@pytest.mark.service("nats")
async def test_a_nats_outage_is_degraded_with_its_cause_and_ok_after(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    waiter: Wait,
) -> None:
    @subscribe("it.health.ping", group="health")
    async def on_ping(event: Ping, ctx: Context) -> None:
        pass

    url = f"sqlite:///{tmp_path / 'health.db'}"
    try:
        server = NatsServer()
    except NatsServerUnavailable as exc:
        service_unavailable(str(exc))
    with server:
        broker = f"{server.url}?stream={unique_name('EF').upper()}&publish_timeout=1"
        app = App("health", broker=broker, store=url, handlers=[on_ping], heartbeat_interval=BEAT)
        caplog.set_level(logging.INFO, logger="eventflow.nats")
        async with app:
            data, text = await _until_status(url, capsys, waiter, "ok")
            assert "DEGRADED" not in text
            await asyncio.to_thread(server.kill)
            data, text = await _until_status(url, capsys, waiter, "degraded")
            (inst,) = data["instances"]
            (problem,) = inst["problems"]
            assert problem.startswith("broker: disconnected from NATS at nats://127.0.0.1:")
            assert " since 20" in problem and "reconnecting" in problem
            assert "DEGRADED" in text and "disconnected from NATS" in text
            await asyncio.to_thread(server.start)
            data, text = await _until_status(url, capsys, waiter, "ok")
            assert data["instances"][0]["problems"] == []
            await app.publish(Ping(n=1), key="k")  # publishes work again
            # the group's lag, asked of the broker for what the heartbeat subscribes to
            capsys.readouterr()
            argv = ["status", "--store", url, "--broker", broker, "--json"]
            assert await asyncio.to_thread(main, argv) == 0
            (group,) = json.loads(capsys.readouterr().out)["groups"]
            assert (group["group"], group["pattern"]) == ("health", "it.health.ping")
            assert group["lag_messages"] in (0, 1) and group["lag_seconds"] is not None
        reconnects = [r.getMessage() for r in caplog.records if "reconnected" in r.getMessage()]
        assert reconnects and all("ParseResult" not in m for m in reconnects), reconnects
        assert all(isinstance(app.broker, NatsBroker) and "nats://" in m for m in reconnects)


async def test_a_failing_projection_is_degraded_with_its_event_and_ok_after(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], waiter: Wait
) -> None:
    url = f"sqlite:///{tmp_path / 'proj.db'}"
    tallies = Tallies()
    app = App("tallying", store=url, projections=[tallies], heartbeat_interval=BEAT)
    async with app:
        await app.store.append("tally-1", [Tally(n=1)])
        data, text = await _until_status(url, capsys, waiter, "degraded")
        (problem,) = data["instances"][0]["problems"]
        assert problem.startswith("projection it_health_tallies: failing on event @1")
        assert "since 20" in problem and "ValueError: tally 1 does not add up" in problem
        assert "DEGRADED" in text and "it_health_tallies" in text
        # projections status, from the store alone: the lease holder and the runner's error
        capsys.readouterr()
        argv = ["projections", "status", "--store", url]
        assert await asyncio.to_thread(main, argv) == 0
        text = capsys.readouterr().out
        row = next(line for line in text.splitlines() if line.startswith("it_health_tallies"))
        assert row.split()[1:] == ["0", "1", "1", "yes"]  # checkpoint, last, lag, running
        assert "failing on event @1" in text and "ValueError: tally 1" in text
        assert await asyncio.to_thread(main, [*argv, "--lock-timeout", "0"]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if "tallies" in line)
        assert row.split()[-1] == "?"  # not looked up
        tallies.broken = False
        data, text = await _until_status(url, capsys, waiter, "ok")
        assert tallies.seen == [1]


async def test_a_stopped_app_releases_its_failing_projections_lease(
    tmp_path: Path, waiter: Wait
) -> None:
    """Stopped while its projection waited in its failure backoff, the app kept the lease
    until it expired (the supervisor's cancellation interrupted the release)."""
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    tallies = Tallies()
    app = App("leasing", store=url, projections=[tallies])
    async with app:
        await app.store.append("tally-1", [Tally(n=1)])
        await waiter(lambda: app.projection_runners[0].failures >= 2, what="two failures")
    async with open_store(url) as store:
        assert await store.leases.holder(lease_name("it_health_tallies")) is None


APP_MODULE = """
from eventflow import App, Envelope, subscribe
from eventflow.projections import Projection


@subscribe("it.health.ping", group="health-down")
async def on_ping(envelope: Envelope) -> None:
    pass


class Never(Projection, name="it_health_never"):
    pass


app = App("health-down", broker={broker!r}, store={store!r}, handlers=[on_ping],
          projections=[Never()])
"""


@pytest.mark.service("nats")
async def test_status_of_an_app_with_no_instance_running_shows_its_groups_lag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every instance down is when a group's lag grows; ``status --app`` listed the groups
    of the running instances' heartbeats only, so it showed none (nor the app's projection
    that has no checkpoint yet), though the app's code names them."""
    url = f"sqlite:///{tmp_path / 'down.db'}"
    try:
        server = NatsServer()
    except NatsServerUnavailable as exc:
        service_unavailable(str(exc))
    with server:
        broker = f"{server.url}?stream={unique_name('EF').upper()}"
        (tmp_path / "health_down_app.py").write_text(APP_MODULE.format(broker=broker, store=url))
        spec = ["--app", "health_down_app:app", "--app-dir", str(tmp_path)]
        assert await asyncio.to_thread(main, ["groups", "declare", *spec[1:]]) == 0
        sys.modules.pop("health_down_app")  # each command is a process of its own
        async with App("health-sender", broker=broker, store=url) as sender:
            for n in range(3):
                await sender.publish(Ping(n=n), key=f"k{n}")
        capsys.readouterr()
        assert await asyncio.to_thread(main, ["status", *spec, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["instances"] == []
        (group,) = data["groups"]
        assert (group["group"], group["pattern"]) == ("health-down", "it.health.ping")
        assert group["lag_messages"] == 3, group
        assert group["lag_seconds"] >= 0
        (proj,) = data["projections"]
        assert (proj["name"], proj["checkpoint"]) == ("it_health_never", 0)
        # --watch asks the broker every round: after the first it said "this NATS broker
        # was closed; create a new one" (each round closed the one broker object)
        sys.modules.pop("health_down_app")
        rounds: list[float] = []

        async def nap(seconds: float) -> None:
            rounds.append(seconds)
            if len(rounds) == 3:
                raise KeyboardInterrupt

        monkeypatch.setattr("eventflow.cli.status._nap", nap)
        argv = ["status", *spec, "--watch", "0.1", "--json"]
        assert await asyncio.to_thread(main, argv) == 0
        reports = [json.loads(line) for line in capsys.readouterr().out.split("\n") if line]
        assert len(reports) == 3
        assert [r["groups"][0].get("lag_messages") for r in reports] == [3, 3, 3], reports
