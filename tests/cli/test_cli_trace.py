"""``eventflow trace``: the causal tree of a correlation from the store and dead letters."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from eventflow import DeadLetter, Event, open_store
from eventflow.cli import main
from eventflow.events import to_envelope


class TraceOrdered(Event, type="cli.trace.ordered"):
    """Root."""

    n: int


class TraceReserved(Event, type="cli.trace.reserved"):
    """Child."""

    n: int


def _fill(url: str) -> str:
    root = to_envelope(TraceOrdered(n=1), source="orders")
    child = to_envelope(
        TraceReserved(n=1),
        source="inventory",
        correlation_id=root.correlation_id,
        causation_id=root.id,
    )
    grandchild = to_envelope(
        TraceReserved(n=2),
        source="billing",
        correlation_id=root.correlation_id,
        causation_id=child.id,
    )
    other = to_envelope(TraceOrdered(n=9), source="orders")

    async def run() -> None:
        async with open_store(url) as store:
            await store.append("order-1", [root, other])
            await store.append("stock-1", [child])
            await store.dead_letters.add(
                DeadLetter(
                    id="dl-1",
                    topic="cli.trace.reserved",
                    group="billing",
                    payload=grandchild.to_bytes(),
                    error="ValueError: card declined\nTraceback ...",
                    attempts=3,
                    failed_at=datetime.now(UTC),
                )
            )

    asyncio.run(run())
    return root.correlation_id


def test_trace_prints_the_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'trace.db'}"
    correlation = _fill(url)
    assert main(["trace", correlation, "--store", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"correlation {correlation}: 3 stored message(s)"
    types = [line.strip().split()[0] for line in out[1::2]]
    depths = [len(line) - len(line.lstrip()) for line in out[1::2]]
    assert types == ["cli.trace.ordered", "cli.trace.reserved", "cli.trace.reserved"]
    assert depths == [2, 4, 6]  # each under its cause
    assert "DEAD LETTER of group billing: ValueError: card declined" in out[-1]


def test_trace_json_and_unknown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'trace.db'}"
    correlation = _fill(url)
    assert main(["trace", correlation, "--json", "--store", url]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    assert len(doc["messages"]) == 3
    assert main(["trace", "nope", "--store", url]) == 1
    assert "no stored message" in capsys.readouterr().err


def test_trace_mermaid_draws_each_message_under_its_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'trace.db'}"
    correlation = _fill(url)
    assert main(["trace", correlation, "--mermaid", "--store", url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "flowchart TD"
    boxes = {line.split("[", 1)[0].strip(): line for line in out if '["' in line}
    assert len(boxes) == 3
    assert "cli.trace.ordered v1" in boxes["m1"] and "cli.trace.reserved v1" in boxes["m2"]
    assert "DEAD LETTER of group billing" in boxes["m3"]
    assert sorted(line.strip() for line in out if "-->" in line) == ["m1 --> m2", "m2 --> m3"]


def test_trace_finds_a_correlation_in_a_store_made_before_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SQLite store made by an earlier version (no ef_events_correlation) gets the index
    when it is next opened, and trace finds through it what was stored before."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'old.db'}"
    correlation = _fill(url)
    with sqlite3.connect(tmp_path / "old.db") as conn:
        conn.execute("DROP INDEX ef_events_correlation")
    assert main(["trace", correlation, "--store", url]) == 0
    assert "3 stored message(s)" in capsys.readouterr().out
    with sqlite3.connect(tmp_path / "old.db") as conn:
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT position FROM ef_events WHERE "
            "json_extract(CAST(envelope AS TEXT), '$.correlation_id') = ?",
            (correlation,),
        ).fetchall()
    assert "ef_events_correlation" in str(plan)


def test_trace_names_the_groups_that_handled_a_cause_only_the_broker_carried(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command that caused a stored event was never stored (it went through the broker
    only), but the group that handled it recorded that in its dedup table: trace says so."""
    from cli_support import fill, make_beat

    url = f"sqlite:///{tmp_path / 'hops.db'}"
    command_id = "0193aaaa-0000-7000-8000-00000000c0de"
    effect = to_envelope(
        TraceReserved(n=3), source="inventory", correlation_id="corr-hop", causation_id=command_id
    )

    async def run() -> None:
        async with open_store(url) as store:
            await store.append("stock-3", [effect])
            await store.dedup.mark("inventory", command_id)
            await store.dedup.mark("billing", "some-other-message")

    asyncio.run(run())
    fill(url, beats=[make_beat("inventory", subscriptions=("inventory:cli.trace.*",))])
    fill(url, beats=[make_beat("billing", subscriptions=("billing:cli.trace.*",))])
    assert main(["trace", "corr-hop", "--store", url]) == 0
    out = capsys.readouterr().out
    assert f"(caused by {command_id}, not stored; handled by group inventory on the broker)" in out
    assert main(["trace", "corr-hop", "--store", url, "--json"]) == 0
    (msg,) = orjson.loads(capsys.readouterr().out)["messages"]
    assert msg["cause_handled_by"] == ["inventory"]
