"""`eventflow status`: instances from the heartbeats table and DLQ counts per group."""

from __future__ import annotations

import json

import pytest
from cli_support import fill, make_beat

from eventflow.cli import main


def test_status_lists_instances_and_dead_letters(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(store_url, beats=[make_beat("billing", age=1.0), make_beat("shipping", age=300.0)])
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert "app instances: 1 running, 1 stale" in out
    billing = next(line for line in out.splitlines() if "billing@host:42:abc" in line)
    assert "billing:invoice.*" in billing
    assert "handled=10 duplicates=2" in billing and "retries" not in billing  # zeros hidden
    shipping = next(line for line in out.splitlines() if "shipping@host:42:abc" in line)
    assert "5m stale" in shipping
    assert "dead letters: 3" in out
    counts = {
        line.split()[0]: line.split()[1]
        for line in out.split("dead letters: 3", 1)[1].split("\n\n")[0].splitlines()
        if line.strip() and not line.strip().startswith(("GROUP", "inspect"))
    }
    assert counts == {"billing": "2", "shipping": "1"}


def test_status_json(store_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    fill(store_url, beats=[make_beat("billing", age=2.0)])
    assert main(["status", "--store", store_url, "--json", "--stale", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dead_letters"] == {"billing": 2, "shipping": 1}
    (inst,) = data["instances"]
    assert inst["app"] == "billing" and inst["pid"] == 42
    assert inst["stale"] is True and inst["age_seconds"] >= 2.0
    assert inst["subscriptions"] == ["billing:invoice.*"]
    assert inst["stats"]["handled"] == 10


def test_status_of_an_idle_store(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path}/idle.db"
    fill(url)
    assert main(["status", "--store", url]) == 0
    out = capsys.readouterr().out
    assert "app instances: 0 running" in out
    assert "no app is running against this store" in out
    assert "dead letters: 0" in out


def test_status_needs_a_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVENTFLOW_STORE", raising=False)
    assert main(["status"]) == 2
    assert "no store given" in capsys.readouterr().err


def test_status_shows_projection_lag_sagas_and_asks_for_a_broker_for_group_lag(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Projection lag comes from the store; group lag needs the broker, and without one the
    report says how to get it instead of leaving it out silently."""
    import asyncio

    from eventflow import Event, open_store

    class Noted(Event, type="cli.status.noted"):
        n: int

    async def go() -> None:
        async with open_store(store_url) as store:
            await store.append("notes-1", [Noted(n=i) for i in range(5)])
            await store.checkpoints.set("note_index", 2)

    asyncio.run(go())
    fill(store_url, beats=[make_beat("billing", age=1.0)])
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("note_index"))
    assert row.split()[:3] == ["note_index", "2", "3"]  # checkpoint, lag in events
    assert row.split()[3].endswith("s")  # the first unhandled event's age
    assert "group lag needs the broker: pass --broker URL" in out
    assert main(["status", "--store", store_url, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (proj,) = data["projections"]
    assert proj["name"] == "note_index" and proj["lag_events"] == 3
    assert proj["lag_seconds"] >= 0 and data["groups"] == [] and data["sagas"] == {}


def test_status_watch_redraws_until_interrupted(
    store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--watch`` prints the report again every interval; Ctrl-C ends it with exit 0."""
    naps: list[float] = []

    async def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("eventflow.cli.status._nap", nap)
    assert main(["status", "--store", store_url, "--watch", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.count("dead letters: 3") == 2 and naps == [0.5, 0.5]
    assert main(["status", "--store", store_url, "--watch", "0"]) == 2
    assert "--watch takes a number of seconds > 0" in capsys.readouterr().err


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_status_with_the_broker_down_still_shows_the_instances_and_why_lag_is_missing(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The broker being down is when a person runs ``status``: it used to end in
    ``eventflow: error: BrokerError: cannot connect`` (exit 1), hiding the DEGRADED
    instances and their causes, because asking for the groups' lag could not connect."""
    problem = "broker: disconnected from NATS at nats://127.0.0.1:4222 since 2026-12-02 03:09:26Z"
    beat = make_beat("billing", health="degraded", problems=(problem,))
    fill(store_url, beats=[beat])
    broker = f"nats://127.0.0.1:{_closed_port()}?connect_timeout=2"
    assert main(["status", "--store", store_url, "--broker", broker]) == 0
    out = capsys.readouterr().out
    assert "DEGRADED" in out and problem in out
    groups = out.split("consumer groups:", 1)[1]
    assert "cannot ask the broker for the groups' lag" in groups and "BrokerError" in groups
    assert main(["status", "--store", store_url, "--broker", broker, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["instances"][0]["problems"] == [problem]
    (group,) = data["groups"]
    assert (group["group"], group["pattern"]) == ("billing", "invoice.*")
    assert group["lag_messages"] is None and "BrokerError" in group["error"]


def test_status_shows_a_projection_failing_before_its_first_checkpoint(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A projection that fails on its first batch has no checkpoint row; the instance that
    runs it reports it. ``projections status`` listed it and ``status`` left it out."""
    import asyncio

    from eventflow import Event, open_store

    class Counted(Event, type="cli.status.counted"):
        n: int

    async def go() -> None:
        async with open_store(store_url) as store:
            await store.append("counts-1", [Counted(n=i) for i in range(4)])

    asyncio.run(go())
    problem = "projection counts: failing on event @1 ('cli.status.counted') since 2026-12-02"
    fill(store_url, beats=[make_beat("billing", health="degraded", problems=(problem,))])
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip().startswith("counts "))
    assert row.split()[:3] == ["counts", "0", "4"]  # no checkpoint yet, 4 events behind
    assert main(["status", "--store", store_url, "--json"]) == 0
    (proj,) = json.loads(capsys.readouterr().out)["projections"]
    assert (proj["name"], proj["checkpoint"], proj["lag_events"]) == ("counts", 0, 4)
    assert proj["lag_seconds"] >= 0
