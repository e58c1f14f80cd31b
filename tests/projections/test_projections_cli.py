"""``eventflow projections list|status|rebuild`` against an app module on a SQLite store."""

from __future__ import annotations

import asyncio
import io
import itertools
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from projection_support import append_events, opened

from eventflow.cli import main
from eventflow.cli.projections import ProgressBar
from eventflow.projections import lease_name

EVENTS = 300
_modules = itertools.count()

APP_MODULE = '''
from eventflow import App
from eventflow.projections import Projection
from eventflow.sourcing.on import on
from projection_support import ItemAdded, ItemRemoved


class SqlStock(Projection, name="cli_stock"):
    """Stock levels in a table of the app's SQLite store."""

    async def reset(self, tx):
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS cli_stock (sku TEXT PRIMARY KEY, qty INTEGER NOT NULL)"
        )
        await tx.execute("DELETE FROM cli_stock")

    @on(ItemAdded)
    async def _added(self, e, ctx):
        await self._add(ctx, e.sku, e.qty)

    @on(ItemRemoved)
    async def _removed(self, e, ctx):
        await self._add(ctx, e.sku, -e.qty)

    async def _add(self, ctx, sku, qty):
        await ctx.transaction().execute(
            "INSERT INTO cli_stock (sku, qty) VALUES ($1, $2) ON CONFLICT (sku) "
            "DO UPDATE SET qty = cli_stock.qty + excluded.qty",
            sku,
            qty,
        )


URL = {url!r}
try:
    app = App("shop", store=URL, projections=[SqlStock()])
except TypeError:  # App without projections= yet
    app = App("shop", store=URL)
    app.projections = (SqlStock(),)
'''


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """(MODULE:APP, app dir, database path): an app module and a store holding EVENTS events."""
    db = tmp_path / "shop.db"
    url = f"sqlite:///{db}"
    module = f"cli_shop_{next(_modules)}"
    (tmp_path / f"{module}.py").write_text(APP_MODULE.format(url=url))

    async def fill() -> None:
        async with opened(url) as store:
            await append_events(store, EVENTS, per_append=25)

    asyncio.run(fill())
    yield f"{module}:app", tmp_path, str(db)


def _cli(shop: tuple[str, Path, str], *args: str) -> int:
    spec, app_dir, _ = shop
    return main(["projections", *args, "--app", spec, "--app-dir", str(app_dir)])


def _expected_levels() -> dict[str, int]:
    levels: dict[str, int] = {}
    for i in range(EVENTS):
        sku, qty = f"sku-{i % 7}", 0
        if i % 3 == 0:
            qty = 1 + i % 5
        elif i % 3 == 1:
            qty = -(1 + i % 2)
        else:
            continue
        levels[sku] = levels.get(sku, 0) + qty
    return levels


def test_list_shows_names_classes_and_types(
    shop: tuple[str, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(shop, "list") == 0
    out = capsys.readouterr().out
    assert "NAME" in out and "cli_stock" in out and "SqlStock" in out
    assert "projtest.item.added, projtest.item.removed" in out
    assert _cli(shop, "list", "--json") == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data == {
        "name": "cli_stock",
        "class": "SqlStock",
        "handles": ["projtest.item.added", "projtest.item.removed"],
    }


def test_rebuild_replays_with_a_progress_bar_and_status_shows_no_lag(
    shop: tuple[str, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(shop, "status", "--json") == 0
    before = orjson.loads(capsys.readouterr().out)
    assert before == {
        "name": "cli_stock",
        "checkpoint": 0,
        "last_position": EVENTS,
        "lag": EVENTS,
        "running": False,
        "problems": [],
    }

    assert _cli(shop, "rebuild", "cli_stock", "--batch-size", "40") == 0
    captured = capsys.readouterr()
    assert f"rebuilt projection 'cli_stock' up to position {EVENTS}" in captured.out
    assert "\r" in captured.err and "100.0%" in captured.err
    assert f"{EVENTS}/{EVENTS} events" in captured.err and captured.err.endswith("\n")
    with sqlite3.connect(shop[2]) as conn:
        assert dict(conn.execute("SELECT sku, qty FROM cli_stock")) == _expected_levels()

    assert _cli(shop, "status") == 0
    out = capsys.readouterr().out
    assert "LAG" in out and "cli_stock" in out
    row = next(line.split() for line in out.splitlines() if line.startswith("cli_stock"))
    assert row == ["cli_stock", str(EVENTS), str(EVENTS), "0", "no"]

    # a second rebuild gives the same table (reset dropped the first one's rows)
    assert _cli(shop, "rebuild", "cli_stock", "--quiet") == 0
    assert capsys.readouterr().err == ""
    with sqlite3.connect(shop[2]) as conn:
        assert dict(conn.execute("SELECT sku, qty FROM cli_stock")) == _expected_levels()


@pytest.fixture
def held_lease(shop: tuple[str, Path, str]) -> Iterator[None]:
    """The projection's lease held by another store instance (as another process would)."""
    acquired, release = threading.Event(), threading.Event()

    async def hold() -> None:
        async with (
            opened(f"sqlite:///{shop[2]}") as store,
            store.leases.hold(lease_name("cli_stock")),
        ):
            acquired.set()
            while not release.is_set():
                await asyncio.sleep(0.01)

    thread = threading.Thread(target=asyncio.run, args=(hold(),))
    thread.start()
    assert acquired.wait(10), "the lease holder did not start"
    try:
        yield
    finally:
        release.set()
        thread.join(10)


def test_rebuild_refuses_while_an_app_holds_the_lease(
    shop: tuple[str, Path, str], held_lease: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(shop, "rebuild", "cli_stock", "--lock-timeout", "0.2") == 1
    err = capsys.readouterr().err
    assert "is running in another instance" in err and "--force" in err
    assert "is held by" in err  # names the holder
    assert _cli(shop, "status", "--json", "--lock-timeout", "0.2") == 0
    assert orjson.loads(capsys.readouterr().out)["running"] is True
    with sqlite3.connect(shop[2]) as conn:  # nothing was reset or replayed
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert "cli_stock" not in tables


def test_usage_errors_say_what_to_do(
    shop: tuple[str, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(shop, "rebuild", "nope") == 2
    assert "no projection named 'nope' (its projections: cli_stock)" in capsys.readouterr().err
    assert main(["projections", "rebuild", "cli_stock", "--store", f"sqlite:///{shop[2]}"]) == 2
    assert "needs --app MODULE:APP" in capsys.readouterr().err
    assert main(["projections", "list"]) == 1
    assert "needs --app" in capsys.readouterr().err


def test_status_of_a_store_alone_lists_its_checkpoints(
    shop: tuple[str, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli(shop, "rebuild", "cli_stock", "--quiet") == 0
    capsys.readouterr()
    assert main(["projections", "status", "--store", f"sqlite:///{shop[2]}", "--json"]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"name": "cli_stock", "checkpoint": EVENTS, "lag": 0}.items() <= next(
        r for r in rows if r["name"] == "cli_stock"
    ).items()


def test_status_of_a_store_alone_takes_names(
    shop: tuple[str, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``status NAME --store`` (no app) was refused with "the app has no projection named"
    although no app was given and the store has that projection's checkpoint."""
    assert _cli(shop, "rebuild", "cli_stock", "--quiet") == 0
    store = ["--store", f"sqlite:///{shop[2]}"]
    capsys.readouterr()
    assert main(["projections", "status", "cli_stock", *store, "--json"]) == 0
    (row,) = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["name"], row["checkpoint"]) == ("cli_stock", EVENTS)
    assert main(["projections", "status", "nope", *store]) == 2
    err = capsys.readouterr().err
    assert "the store has no projection named 'nope' (its projections: cli_stock)" in err


def test_progress_bar_throttles_and_finishes_the_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, "p", width=10, interval=3600)
    bar(0, 100)
    bar(50, 100)  # within the interval: not drawn
    bar(100, 100)  # the end is always drawn
    bar.finish()
    text = out.getvalue()
    assert text.count("\r") == 2 and "50/100" not in text and "0.0% 0/100" in text
    assert "[##########] 100.0% 100/100 events" in text and text.endswith("\n")
