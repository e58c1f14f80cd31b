"""The SQLite store: dedup, dead letters and heartbeats persist in one file across reopen."""

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from eventflow import (
    App,
    ConcurrencyError,
    ConfigurationError,
    Context,
    DeadLetter,
    Envelope,
    Event,
    StoreError,
    open_store,
    subscribe,
)
from eventflow.adapters.sqlite import SqliteStore
from eventflow.adapters.sqlite.connect import begin_immediate, connect
from eventflow.adapters.sqlite.db import SqliteDatabase
from eventflow.ports import Heartbeat

Wait = Callable[..., Awaitable[None]]


class Ping(Event, type="it.sqlite.ping"):
    n: int


def url(tmp_path: Path, name: str = "x.db") -> str:
    return f"sqlite:///{tmp_path}/{name}"


def letter(n: int, group: str = "g", **overrides: object) -> DeadLetter:
    fields: dict[str, object] = {
        "id": f"dl-{n}",
        "topic": "it.sqlite.ping",
        "group": group,
        "payload": b"\x00\xff raw bytes " + str(n).encode(),
        "error": f"RuntimeError: failure {n}\nTraceback ...",
        "attempts": n,
        "failed_at": datetime(2024, 5, 1, 12, 0, n, 123456, tzinfo=UTC),
        "reason": "handler-failed",
        "key": f"k-{n}",
        "headers": {"traceparent": "00-abc", "Odd Name": "ü"},
        "envelope_id": f"env-{n}",
        "source": {"partition": 3, "offset": 40 + n},
    }
    fields.update(overrides)
    return DeadLetter(**fields)  # type: ignore[arg-type]


# -- dedup -------------------------------------------------------------------------------------


async def test_dedup_marks_persist_across_reopen(tmp_path: Path) -> None:
    async with open_store(url(tmp_path)) as store:
        assert not await store.dedup.seen("g", "m-1")
        await store.dedup.mark("g", "m-1")
        await store.dedup.mark("g", "m-1")  # idempotent
        assert await store.dedup.seen("g", "m-1")
        assert not await store.dedup.seen("other-group", "m-1")
        assert not await store.dedup.seen("g", "m-2")

    reopened = await open_store(url(tmp_path))
    try:
        assert isinstance(reopened, SqliteStore)
        assert await reopened.dedup.seen("g", "m-1")  # from the file, not a cache
        assert not await reopened.dedup.seen("other-group", "m-1")
    finally:
        await reopened.close()


async def test_a_dedup_table_of_an_earlier_version_gets_its_cancellation_column(
    tmp_path: Path,
) -> None:
    """A file whose ``ef_dedup`` predates ``cancelled_by`` gets the column at open, keeping
    its entries (plain handled ones); cancellations work."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE ef_dedup (grp TEXT NOT NULL, message_id TEXT NOT NULL, "
            "handled_at REAL NOT NULL, PRIMARY KEY (grp, message_id)) WITHOUT ROWID"
        )
        conn.execute("INSERT INTO ef_dedup VALUES ('g', 'old', 1.0)")
    conn.close()
    store = SqliteStore.from_url(f"sqlite:///{path}")
    await store.open()
    try:
        assert await store.dedup.seen("g", "old")
        assert await store.dedup.cancelled_by("g", "old") is None
        assert await store.dedup.mark_new("g", "new", cancelled_by="undo")
        assert await store.dedup.cancelled_by("g", "new") == "undo"
    finally:
        await store.close()


async def test_dedup_is_shared_by_two_stores_on_one_file(tmp_path: Path) -> None:
    async with open_store(url(tmp_path)) as a, open_store(url(tmp_path)) as b:
        await a.dedup.mark("g", "shared")
        assert await b.dedup.seen("g", "shared")


# -- dead letters ------------------------------------------------------------------------------


async def test_dead_letters_round_trip(tmp_path: Path) -> None:
    letters = [letter(1), letter(2, group="h"), letter(3, key=None, envelope_id=None)]
    async with open_store(url(tmp_path)) as store:
        dlq = store.dead_letters
        for d in letters:
            await dlq.add(d)
        assert await dlq.list() == letters  # oldest first, every field intact
        assert await dlq.get("dl-2") == letters[1]
        assert await dlq.get("nope") is None
        assert await dlq.list(group="g") == [letters[0], letters[2]]
        assert await dlq.list(limit=2) == letters[:2]
        assert await dlq.count() == {"g": 2, "h": 1}

    async with open_store(url(tmp_path)) as store:
        dlq = store.dead_letters
        got = await dlq.get("dl-1")
        assert got == letters[0]
        assert got is not None
        assert got.payload == letters[0].payload
        assert got.failed_at == letters[0].failed_at
        assert got.failed_at.utcoffset() == timedelta(0)
        assert dict(got.headers) == {"traceparent": "00-abc", "Odd Name": "ü"}
        assert dict(got.source) == {"partition": 3, "offset": 41}
        assert await dlq.remove(["dl-1", "dl-3", "missing"]) == 2
        assert await dlq.list() == [letters[1]]
        assert await dlq.count() == {"h": 1}
        assert await dlq.remove(["dl-1"]) == 0


# -- heartbeats --------------------------------------------------------------------------------


async def test_heartbeats_round_trip(tmp_path: Path) -> None:
    t0 = datetime(2024, 5, 1, 12, tzinfo=UTC)
    a = Heartbeat("svc", "svc@h:1", "h", 1, t0, t0, ("g:a.b",), {"handled": 3})
    b = Heartbeat("svc", "svc@h:2", "h", 2, t0, t0 + timedelta(seconds=5), (), {})
    async with open_store(url(tmp_path)) as store:
        await store.heartbeats.beat(a)
        await store.heartbeats.beat(b)
        assert await store.heartbeats.list() == [b, a]  # newest first
        a2 = Heartbeat("svc", "svc@h:1", "h", 1, t0, t0 + timedelta(seconds=9), ("g:a.b",), {})
        await store.heartbeats.beat(a2)  # replaces the instance's record
        assert await store.heartbeats.list() == [a2, b]
    async with open_store(url(tmp_path)) as store:
        assert [hb.instance for hb in await store.heartbeats.list()] == ["svc@h:1", "svc@h:2"]
        await store.heartbeats.remove("svc@h:1")
        await store.heartbeats.remove("svc@h:1")
        assert await store.heartbeats.list() == [b]


# -- urls and lifecycle ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["sqlite://host/x.db", "sqlite:///", "sqlite://"])
def test_bad_sqlite_urls(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="SQLite URL"):
        SqliteStore.from_url(bad)


def test_sqlite_url_paths(tmp_path: Path) -> None:
    assert SqliteStore.from_url(f"sqlite:///{tmp_path}/a.db").path == f"{tmp_path}/a.db"
    assert SqliteStore.from_url("sqlite:///rel/a.db").path == "rel/a.db"
    assert SqliteStore.from_url("sqlite:///a%20b.db").path == "a b.db"


@pytest.mark.parametrize(
    ("bad", "right"), [("sqlite:/x.db", "sqlite:////x.db"), ("sqlite:x.db", "sqlite:///x.db")]
)
def test_sqlite_urls_missing_slashes_open_nothing(
    bad: str, right: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError, match="SQLite URL") as info:
        open_store(bad)
    assert right in str(info.value)
    assert list(tmp_path.iterdir()) == []  # sqlite:/x.db used to create ./x.db


def test_sqlite_urls_refuse_unknown_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"unknown option 'timeout'.*busy_timeout"):
        open_store(url(tmp_path) + "?timeout=1")


async def test_busy_timeout_option_bounds_the_wait_for_another_writer(tmp_path: Path) -> None:
    async with (
        open_store(url(tmp_path)) as holder,
        open_store(url(tmp_path) + "?busy_timeout=0.3") as waiter,
    ):
        assert isinstance(holder, SqliteStore)
        async with holder.transaction():
            await holder.dedup.mark("g", "held")  # holds the file's write lock
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(StoreError, match="locked"):
                await waiter.dedup.mark("g", "blocked")
            waited = loop.time() - started
        # Positive control: once the holder committed, the same write goes through.
        await waiter.dedup.mark("g", "blocked")
        assert await holder.dedup.seen("g", "blocked")
    # It waited for the lock (about busy_timeout), not the 5 s default.
    assert 0.2 <= waited < 2.5, waited


async def test_store_is_unusable_before_open_and_after_close(tmp_path: Path) -> None:
    store = SqliteStore.from_url(url(tmp_path))
    with pytest.raises(StoreError, match="not open"):
        await store.dedup.seen("g", "x")
    await store.open()
    await store.open()  # idempotent
    await store.dedup.mark("g", "x")
    await store.close()
    await store.close()  # idempotent
    with pytest.raises(StoreError):
        await store.dedup.mark("g", "y")
    assert (tmp_path / "x.db").exists()


# -- an app on SQLite --------------------------------------------------------------------------


async def test_app_dedups_a_duplicate_after_restart(
    tmp_path: Path, broker_url: str, waiter: Wait
) -> None:
    handled: list[tuple[str, int]] = []

    @subscribe("it.sqlite.ping", group="persistent")
    async def handle(event: Ping, ctx: Context) -> None:
        handled.append((ctx.envelope.id, event.n))

    store_url = url(tmp_path)
    async with App("it-sqlite", broker=broker_url, store=store_url, handlers=[handle]) as app:
        original = await app.publish(Ping(n=1), key="p")
        await waiter(lambda: len(handled) == 1)

    # A new process would start with empty caches: a new App and a new store object.
    async with App("it-sqlite", broker=broker_url, store=store_url, handlers=[handle]) as app:
        await app.publish(original)  # the producer retried: same envelope id
        marker = await app.publish(Ping(n=2), key="p")  # same key: handled after the duplicate
        # The stats, not the handler's list: a handler returns before its commit counts.
        await waiter(lambda: app.stats()["persistent:it.sqlite.ping"]["handled"] == 1)
        stats = app.stats()["persistent:it.sqlite.ping"]
    assert handled == [(original.id, 1), (marker.id, 2)]
    assert stats["duplicates"] == 1
    assert stats["handled"] == 1


async def test_app_dead_letters_survive_a_restart(
    tmp_path: Path, broker_url: str, waiter: Wait
) -> None:
    @subscribe("it.sqlite.ping", group="dlq-persist", retry=1)
    async def handle(event: Ping) -> None:
        raise RuntimeError("persist me")

    store_url = url(tmp_path)
    async with App("it-sqlite-dlq", broker=broker_url, store=store_url, handlers=[handle]) as app:
        env = await app.publish(Ping(n=1))
        await app.broker.publish("it.sqlite.ping", b"not json")
        await waiter(lambda: app.stats()["dlq-persist:it.sqlite.ping"]["dead_lettered"] == 2)

    async with App("it-sqlite-dlq", broker=broker_url, store=store_url, handlers=[handle]) as app:
        letters = await app.dead_letters.list()
        assert {d.reason for d in letters} == {"handler-failed", "malformed"}
        failed = next(d for d in letters if d.reason == "handler-failed")
        assert failed.payload == env.to_bytes()
        assert failed.attempts == 1
        assert "persist me" in failed.error
        assert await app.dead_letters.purge() == 2
        assert await app.dead_letters.list() == []


async def test_app_heartbeats_in_sqlite(tmp_path: Path, broker_url: str) -> None:
    app = App("it-sqlite-hb", broker=broker_url, store=url(tmp_path))
    async with app, open_store(url(tmp_path)) as observer:  # another process's view
        (beat,) = await observer.heartbeats.list()
        assert beat.instance == app.instance
    async with open_store(url(tmp_path)) as observer:
        assert await observer.heartbeats.list() == []


async def test_many_concurrent_marks(tmp_path: Path) -> None:
    async with open_store(url(tmp_path)) as store:
        await asyncio.gather(*(store.dedup.mark("g", f"m-{i}") for i in range(200)))
        seen = await asyncio.gather(*(store.dedup.seen("g", f"m-{i}") for i in range(200)))
        assert all(seen)


# -- transactions that end badly ---------------------------------------------------------------


class _FaultyConnection:
    """Delegates to a ``sqlite3`` connection, except that the statement ``fail`` (its first
    run) signals ``started``, waits for ``release``, then fails like a disk error without
    running: the transaction it should have ended stays open."""

    def __init__(self, conn: sqlite3.Connection, fail: str) -> None:
        self._conn = conn
        self._fail: str | None = fail
        self.started = threading.Event()
        self.release = threading.Event()

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql == self._fail:
            self._fail = None
            self.started.set()
            self.release.wait(10)
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def _open_and_leave(db: SqliteDatabase) -> None:
    """A transaction of one statement: its BEGIN travels with the statement."""
    async with db.transaction() as tx:
        await tx.fetch("SELECT 1")


async def _locked(db: SqliteDatabase, waiter: Wait) -> None:
    """Wait until a task of ``db`` holds its transaction lock and has sent BEGIN."""
    await waiter(db._lock.locked, what="BEGIN IMMEDIATE sent")
    for _ in range(3):
        await asyncio.sleep(0)  # the BEGIN is queued on the thread a loop turn later


async def test_a_begin_that_fails_after_its_caller_was_cancelled_leaves_nothing_open(
    tmp_path: Path, waiter: Wait
) -> None:
    path = str(tmp_path / "busy.db")
    db, other = SqliteDatabase(path, busy_timeout=0.3), SqliteDatabase(path)
    await db.open()
    await other.open()
    try:
        async with other.transaction() as held:  # the write lock, past db's busy timeout
            await held.fetch("SELECT 1")
            task = asyncio.create_task(_open_and_leave(db))
            await _locked(db, waiter)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task  # after the BEGIN gave up waiting: cancelled, not its error
        assert db._conn is not None and not db._conn.in_transaction
        await _open_and_leave(db)  # usable
    finally:
        await db.close()
        await other.close()


async def test_a_transaction_without_statements_goes_nowhere(tmp_path: Path) -> None:
    """A block that ran no statement neither begins nor commits: it does not wait for
    another process's write lock (the positive control: one with a statement does)."""
    path = str(tmp_path / "busy.db")
    db, other = SqliteDatabase(path, busy_timeout=0.2), SqliteDatabase(path)
    await db.open()
    await other.open()
    try:
        async with other.transaction() as held:
            await held.fetch("SELECT 1")
            async with db.transaction():
                pass
            with pytest.raises(StoreError, match="locked"):
                await _open_and_leave(db)
    finally:
        await db.close()
        await other.close()


async def test_a_transaction_cancelled_twice_while_beginning_is_still_rolled_back(
    tmp_path: Path, waiter: Wait
) -> None:
    path = str(tmp_path / "busy.db")
    db, other = SqliteDatabase(path), SqliteDatabase(path)
    await db.open()
    await other.open()
    try:
        async with other.transaction() as held:
            await held.fetch("SELECT 1")
            task = asyncio.create_task(_open_and_leave(db))
            await _locked(db, waiter)
            task.cancel()
            await asyncio.sleep(0.05)
            task.cancel()  # again, while it waits for the BEGIN to come back
            await asyncio.sleep(0.05)
        # other committed: the BEGIN went through, then its ROLLBACK must have too
        with pytest.raises(asyncio.CancelledError):
            await task
        await _open_and_leave(db)  # no "cannot start a transaction within a transaction"
        assert await db.query("SELECT 1") == [(1,)]
    finally:
        await db.close()
        await other.close()


async def test_a_rollback_that_fails_after_its_caller_was_cancelled_is_logged(
    tmp_path: Path, waiter: Wait, caplog: pytest.LogCaptureFixture
) -> None:
    db = SqliteDatabase(str(tmp_path / "x.db"))
    await db.open()
    assert db._conn is not None
    faulty = _FaultyConnection(db._conn, "ROLLBACK")
    db._conn = faulty  # type: ignore[assignment]

    async def fail() -> None:
        async with db.transaction() as tx:
            await tx.execute("CREATE TABLE t (x INTEGER)")
            raise ValueError("the block fails: roll back")

    try:
        with caplog.at_level(logging.WARNING, logger="eventflow.sqlite"):
            task = asyncio.create_task(fail())
            await waiter(faulty.started.is_set, what="the ROLLBACK on the thread")
            task.cancel()
            await asyncio.sleep(0.02)
            faulty.release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        [record] = [r for r in caplog.records if "ROLLBACK" in r.getMessage()]
        assert record.levelno == logging.WARNING
        assert "disk I/O error" in record.getMessage()
        assert "still inside a transaction" in record.getMessage()
        assert "reopen the store" in record.getMessage()
    finally:
        faulty.release.set()
        await db.close()


async def test_a_failed_commit_does_not_leave_the_connection_in_its_transaction(
    tmp_path: Path,
) -> None:
    db = SqliteDatabase(str(tmp_path / "x.db"))
    await db.open("CREATE TABLE t (x INTEGER);")
    assert db._conn is not None
    faulty = _FaultyConnection(db._conn, "COMMIT")
    faulty.release.set()
    db._conn = faulty  # type: ignore[assignment]
    try:
        with pytest.raises(StoreError, match="disk I/O error"):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t VALUES ($1)", 1)
        async with db.transaction() as tx:  # not "within a transaction": it was rolled back
            await tx.execute("INSERT INTO t VALUES ($1)", 2)
            assert await tx.fetch("SELECT x FROM t") == [(2,)]
    finally:
        await db.close()


def _insert_into(conn: sqlite3.Connection, table: str, x: int) -> None:
    conn.execute(f"INSERT INTO {table} VALUES (?)", (x,))


async def test_queued_writes_commit_with_their_transaction(tmp_path: Path) -> None:
    """A queued write runs with the transaction's next statement or its commit: it
    commits with it, and a rollback drops it."""
    db = SqliteDatabase(str(tmp_path / "q.db"))
    await db.open("CREATE TABLE t (x INTEGER);")
    try:
        async with db.transaction() as tx:
            await db.queue(tx, _insert_into, "t", 1)
            assert await tx.fetch("SELECT x FROM t") == [(1,)]  # carried by this statement
            await db.queue(tx, _insert_into, "t", 2)  # carried by the commit
        assert await db.query("SELECT x FROM t ORDER BY x") == [(1,), (2,)]
        with pytest.raises(ValueError):
            async with db.transaction() as tx:
                await db.queue(tx, _insert_into, "t", 3)
                raise ValueError("roll back")
        await db.queue(None, _insert_into, "t", 4)  # no transaction: now, in one of its own
        assert await db.query("SELECT x FROM t ORDER BY x") == [(1,), (2,), (4,)]
    finally:
        await db.close()


async def test_a_queued_write_that_fails_refuses_its_transaction(tmp_path: Path) -> None:
    """A queued write that fails rolls its whole transaction back, even when the statement
    that carried it was caught: its error is raised where the block ends."""
    db = SqliteDatabase(str(tmp_path / "q.db"))
    await db.open("CREATE TABLE t (x INTEGER);")
    try:
        with pytest.raises(StoreError, match="no such table"):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t VALUES ($1)", 1)
                await db.queue(tx, _insert_into, "missing", 1)  # carried by the commit
        with pytest.raises(StoreError, match="no such table"):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t VALUES ($1)", 2)
                await db.queue(tx, _insert_into, "missing", 2)
                with pytest.raises(StoreError, match="no such table"):
                    await tx.fetch("SELECT 1")  # the statement that carried it
        assert await db.query("SELECT x FROM t") == []
        async with db.transaction() as tx:  # the positive control: the same, queued right
            await tx.execute("INSERT INTO t VALUES ($1)", 3)
            await db.queue(tx, _insert_into, "t", 4)
        assert await db.query("SELECT x FROM t ORDER BY x") == [(3,), (4,)]
    finally:
        await db.close()


async def test_calls_outside_an_open_block_wait_for_it_and_never_run_inside_it(
    tmp_path: Path,
) -> None:
    """A read or a write of another context, made while a ``transaction()`` block holds the
    connection, runs after the block ended, not inside its transaction (on the one
    connection it would see, or commit with, the block's uncommitted writes); once no
    block is open it runs at once."""
    db = SqliteDatabase(str(tmp_path / "q.db"))
    await db.open("CREATE TABLE t (x INTEGER);")
    inside, release = asyncio.Event(), asyncio.Event()

    async def block(commit: bool) -> None:
        with contextlib.suppress(ValueError):
            async with db.transaction() as tx:
                await tx.execute("INSERT INTO t VALUES ($1)", 1)
                inside.set()
                await release.wait()
                if not commit:
                    raise ValueError("roll back")

    try:
        for commit in (False, True):
            inside.clear()
            release.clear()
            holder = asyncio.create_task(block(commit))
            await inside.wait()
            read = asyncio.create_task(db.query("SELECT count(*) FROM t WHERE x = 1"))
            write = asyncio.create_task(db.run(_insert_into, "t", 2))
            await asyncio.sleep(0.05)
            assert not read.done() and not write.done()  # they wait for the block
            release.set()
            await holder
            assert await read == [(1 if commit else 0,)]  # never the uncommitted row
            await write
        assert await db.query("SELECT x FROM t ORDER BY x") == [(1,), (2,), (2,)]
    finally:
        await db.close()


def test_begin_immediate_waits_for_another_writer_up_to_the_busy_timeout(
    tmp_path: Path,
) -> None:
    """``begin_immediate`` gets the write lock once another connection releases it and
    fails with "locked" once the busy timeout passed; the connection's own busy timeout is
    0 (the waits are ``busy_wait``'s, in short steps, so no statement sleeps in SQLite)."""
    path = str(tmp_path / "b.db")
    holder = connect(path, 5.0, "CREATE TABLE t (x INTEGER);")
    waiter = connect(path, 0.05, "")
    try:
        assert waiter.execute("PRAGMA busy_timeout").fetchone() == (0,)
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            begin_immediate(waiter, 0.05)  # never released
        release = threading.Timer(0.01, lambda: holder.execute("COMMIT"))
        release.start()
        begin_immediate(waiter, 5.0)  # the positive control: released meanwhile
        release.join()
        waiter.execute("INSERT INTO t VALUES (1)")
        waiter.execute("COMMIT")
    finally:
        holder.close()
        waiter.close()


# -- appends ------------------------------------------------------------------------------------


async def test_an_append_larger_than_one_insert_keeps_every_event_in_order(
    tmp_path: Path,
) -> None:
    # 1,201 events in one append (more rows than one INSERT of 5 parameters each can take).
    async with SqliteStore(str(tmp_path / "big.db")) as store:
        events = [Envelope.create(Ping.event_type, {"n": i}) for i in range(1201)]
        assert await store.append("s-1", events, expected_version=0) == 1201
        assert await store.append("s-1", events, expected_version=0) == 1201  # a retry: as is
        read = [(r.stream_version, r.envelope.data["n"]) async for r in store.read_stream("s-1")]
        assert read == [(i + 1, i) for i in range(1201)]


async def test_an_append_keeps_out_the_events_stored_already_and_checks_the_version(
    tmp_path: Path,
) -> None:
    async with SqliteStore(str(tmp_path / "part.db")) as store:
        first, second = (Envelope.create(Ping.event_type, {"n": n}) for n in (1, 2))
        assert await store.append("s-2", [first], expected_version=0) == 1
        # One stored already, one new: the new one goes in at the stream's version check.
        assert await store.append("s-2", [first, second], expected_version=1) == 2
        with pytest.raises(ConcurrencyError):
            await store.append("s-2", [Ping(n=3)], expected_version=1)
        read = [r.envelope.data["n"] async for r in store.read_stream("s-2")]
        assert read == [1, 2]
