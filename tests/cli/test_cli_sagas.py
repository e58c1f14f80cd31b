"""``eventflow sagas list|show|retry|skip|abort|diagram`` and sagas in ``eventflow trace``,
against a SQLite store whose sagas a real App ran (memory broker).

The trip saga books a hotel, then a flight; the hotel's cancellation waits for a reply
(3 s), so a cancellation nobody answers leaves the saga ``failed``. The command line runs
in a thread while the app runs, as it would beside a live service.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from eventflow import App, Context, Event, Saga, step, subscribe
from eventflow.cli import main
from eventflow.cli.sagas import diagram

Wait = Callable[..., Awaitable[None]]
MODULE = sys.modules[__name__]


class TripRequested(Event, type="clisaga.trip.requested"):
    trip_id: str


class TripCancelled(Event, type="clisaga.trip.cancelled"):
    trip_id: str


class BookHotel(Event, type="clisaga.hotel.book"):
    trip_id: str


class HotelBooked(Event, type="clisaga.hotel.booked"):
    trip_id: str
    room: str


class CancelHotel(Event, type="clisaga.hotel.cancel"):
    trip_id: str


class HotelCancelled(Event, type="clisaga.hotel.cancelled"):
    trip_id: str


class BookFlight(Event, type="clisaga.flight.book"):
    trip_id: str


class FlightBooked(Event, type="clisaga.flight.booked"):
    trip_id: str


class FlightRejected(Event, type="clisaga.flight.rejected"):
    trip_id: str


class TripSaga(Saga, name="clisaga.trip", start=TripRequested, key="trip_id", abort=TripCancelled):
    """Hotel, then flight; the hotel's cancellation is waited for."""

    trip_id: str = ""
    room: str | None = None

    def started(self, e: TripRequested) -> None:
        self.trip_id = e.trip_id

    @step(reply=HotelBooked, timeout=30.0)
    def hotel(self) -> Event:
        return BookHotel(trip_id=self.trip_id)

    @hotel.on_reply
    def _booked(self, e: HotelBooked) -> None:
        self.room = e.room

    @hotel.compensate(reply=HotelCancelled, timeout=3.0)
    def cancel_hotel(self) -> Event:
        return CancelHotel(trip_id=self.trip_id)

    @step(reply=FlightBooked, reject=FlightRejected, timeout=30.0)
    def flight(self) -> Event:
        return BookFlight(trip_id=self.trip_id)


class Ordered(Event, type="clisaga.ordered"):
    n: str


class Pay(Event, type="clisaga.pay"):
    n: str


class Paid(Event, type="clisaga.paid"):
    n: str


class PayDeclined(Event, type="clisaga.pay.declined"):
    n: str


class Refund(Event, type="clisaga.refund"):
    n: str


class Deliver(Event, type="clisaga.deliver"):
    n: str


class Delivered(Event, type="clisaga.delivered"):
    n: str


class DeliveryFailed(Event, type="clisaga.delivery.failed"):
    n: str


class PivotSaga(Saga, name="clisaga.pivot", start=Ordered, key="n"):
    """A pivot (pay), a local step, a retried step after it."""

    n: str = ""

    def started(self, e: Ordered) -> None:
        self.n = e.n

    @step(reply=Paid, reject=PayDeclined, timeout=10.0, pivot=True)
    def pay(self) -> Event:
        return Pay(n=self.n)

    @pay.compensate
    def refund(self) -> Event:
        return Refund(n=self.n)

    @step()
    def note(self) -> None:
        return None

    @step(reply=Delivered, reject=DeliveryFailed, timeout=5.0, retry=2, retry_delay=0.05)
    def deliver(self) -> Event:
        return Deliver(n=self.n)


@dataclass
class Desk:
    """How the participants answer, and what they did."""

    reject_flight: set[str] = field(default_factory=set)
    silent_flight: set[str] = field(default_factory=set)
    cancel_ok: set[str] = field(default_factory=set)
    crash_flight: set[str] = field(default_factory=set)
    log: list[tuple[str, str]] = field(default_factory=list)


def _participants(desk: Desk) -> list[Any]:
    @subscribe(BookHotel.event_type, group="clisaga.hotel")
    async def book_hotel(cmd: BookHotel, ctx: Context) -> None:
        desk.log.append(("hotel", cmd.trip_id))
        await ctx.publish(HotelBooked(trip_id=cmd.trip_id, room=f"r-{cmd.trip_id}"))

    @subscribe(CancelHotel.event_type, group="clisaga.hotel")
    async def cancel_hotel(cmd: CancelHotel, ctx: Context) -> None:
        desk.log.append(("cancel", cmd.trip_id))
        if cmd.trip_id in desk.cancel_ok:
            await ctx.publish(HotelCancelled(trip_id=cmd.trip_id))

    @subscribe(BookFlight.event_type, group="clisaga.flight", retry=1)
    async def book_flight(cmd: BookFlight, ctx: Context) -> None:
        if cmd.trip_id in desk.crash_flight:
            raise RuntimeError(f"no seats for {cmd.trip_id}")
        if cmd.trip_id in desk.silent_flight:
            return
        if cmd.trip_id in desk.reject_flight:
            await ctx.publish(FlightRejected(trip_id=cmd.trip_id))
            return
        desk.log.append(("flight", cmd.trip_id))
        await ctx.publish(FlightBooked(trip_id=cmd.trip_id))

    return [book_hotel, cancel_hotel, book_flight]


SAGA = f"{__name__}:TripSaga"


async def _status(app: App, key: str) -> str | None:
    saga = await app.sagas.get(TripSaga, key)
    return None if saga is None else saga.status


@asynccontextmanager
async def _trips(url: str, broker_url: str, waiter: Wait) -> AsyncIterator[tuple[App, Desk]]:
    """An app running the trip saga with t-ok completed, t-fail and t-skip failed (their
    hotel cancellation unanswered) and t-wait running (its flight never answers)."""
    desk = Desk(reject_flight={"t-fail", "t-skip"}, silent_flight={"t-wait"})
    app = App("trips", broker=broker_url, store=url, handlers=_participants(desk), sagas=[TripSaga])
    async with app:
        for key in ("t-ok", "t-fail", "t-skip", "t-wait"):
            await app.publish(TripRequested(trip_id=key), key=key)
        for key, status in (
            ("t-ok", "completed"),
            ("t-fail", "failed"),
            ("t-skip", "failed"),
        ):
            await _until(app, key, status, waiter)

        async def waiting_for_flight() -> bool:
            saga = await app.sagas.get(TripSaga, "t-wait")
            return saga is not None and any(
                t.kind == "command-sent" and t.step == "flight" for t in saga.history
            )

        await waiter(waiting_for_flight, what="t-wait sends its flight command")
        yield app, desk


async def _until(app: App, key: str, status: str, waiter: Wait) -> None:
    async def check() -> bool:
        return await _status(app, key) == status

    await waiter(check, what=f"saga {key} {status}")


async def _cli(argv: list[str]) -> int:
    """The command line in a thread (it runs its own event loop), beside the running app."""
    return await asyncio.to_thread(main, argv)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'trips.db'}"


# -- list and show -------------------------------------------------------------------------


async def test_a_saga_with_inputs_kept_before_its_start_is_listed_pending(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    desk = Desk()
    app = App("trips", broker=broker_url, store=url, handlers=_participants(desk), sagas=[TripSaga])
    async with app:
        await app.publish(TripCancelled(trip_id="t-early"), key="t-early")  # before its start
        await app.publish(TripRequested(trip_id="t-late"), key="t-late")  # the control
        await _until(app, "t-early", "pending", waiter)
        await _until(app, "t-late", "completed", waiter)
        capsys.readouterr()
        assert await _cli(["sagas", "list", "--store", url, "--status", "pending"]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        assert [(r[0], r[3]) for r in rows] == [("saga-clisaga.trip-t-early", "pending")]
        assert await _cli(["sagas", "show", "saga-clisaga.trip-t-early", "--store", url]) == 0
        out = capsys.readouterr().out
        assert "kept:        1 inputs before its start" in out
        await app.publish(TripRequested(trip_id="t-early"), key="t-early")
        await _until(app, "t-early", "compensated", waiter)  # ended at the start
    assert not any(key == "t-early" for _, key in desk.log)  # nothing was done for it


async def test_list_filters_and_json(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _trips(url, broker_url, waiter):
        pass
    capsys.readouterr()
    assert await _cli(["sagas", "list", "--store", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "NAME", "KEY", "STATUS", "STARTED", "UPDATED"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {f"saga-clisaga.trip-{k}" for k in ("t-ok", "t-fail", "t-skip", "t-wait")}
    assert rows["saga-clisaga.trip-t-ok"][1:4] == ["clisaga.trip", "t-ok", "completed"]
    assert rows["saga-clisaga.trip-t-wait"][3] == "running"

    assert await _cli(["sagas", "list", "--store", url, "--status", "failed", "--json"]) == 0
    found = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(d["key"] for d in found) == ["t-fail", "t-skip"]
    assert {d["status"] for d in found} == {"failed"}
    assert set(found[0]) == {"id", "name", "key", "status", "started", "updated"}

    assert await _cli(["sagas", "list", "--store", url, "--name", "nope"]) == 0
    assert capsys.readouterr().out.startswith("no sagas with name 'nope' in store ")


def test_list_rejects_an_unknown_status(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sagas", "list", "--store", url, "--status", "done"])
    assert exc.value.code == 2
    assert "invalid choice: 'done'" in capsys.readouterr().err


async def test_show_prints_the_history_as_a_table(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _trips(url, broker_url, waiter) as (app, _):
        saga = await app.sagas.get(TripSaga, "t-fail")
        assert saga is not None
        history = saga.history
    capsys.readouterr()
    sid = "saga-clisaga.trip-t-fail"
    assert await _cli(["sagas", "show", sid, "--store", url]) == 0
    out = capsys.readouterr().out.splitlines()
    head = dict(line.split(":", 1) for line in out[:11])
    assert head["id"].strip() == sid
    assert head["status"].strip() == "failed"
    assert "cancel_hotel got no reply within 3.0s" in head["reason"]
    assert orjson.loads(head["state"]) == {"trip_id": "t-fail", "room": "r-t-fail"}
    assert out[11] == f"history ({len(history)} transitions, oldest first):"
    assert out[12].split() == ["AT", "KIND", "STEP", "DETAIL", "BY", "MESSAGE", "ID"]
    table = out[13:]
    assert len(table) == len(history)
    kinds = [line.split()[2] for line in table]  # AT is a date and a time
    assert kinds == [t.kind for t in history]
    assert kinds[:3] == ["started", "command-sent", "replied"]
    assert kinds[-3:] == ["compensation-sent", "timed-out", "failed"]
    for line, t in zip(table, history, strict=True):
        assert line.endswith(t.message_id or "-")
        assert line.startswith(t.at.strftime("%Y-%m-%d %H:%M:%S."))

    assert await _cli(["sagas", "show", sid, "--store", url, "--json"]) == 0
    data = orjson.loads(capsys.readouterr().out)
    assert data["status"] == "failed" and data["key"] == "t-fail"
    assert [t["kind"] for t in data["history"]] == [t.kind for t in history]
    assert [t["message_id"] for t in data["history"]] == [t.message_id for t in history]
    assert data["state"]["room"] == "r-t-fail"

    assert await _cli(["sagas", "show", "saga-clisaga.trip-nope", "--store", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no saga 'saga-clisaga.trip-nope'" in err


# -- retry, skip, abort ----------------------------------------------------------------------


async def test_retry_resumes_a_failed_saga_through_the_outbox(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _trips(url, broker_url, waiter) as (app, desk):
        assert desk.log.count(("cancel", "t-fail")) == 1  # asked once, never answered
        desk.cancel_ok.add("t-fail")
        capsys.readouterr()
        sid = "saga-clisaga.trip-t-fail"
        assert (
            await _cli(["sagas", "retry", sid, "--by", "alice", "--store", url, "--saga", SAGA])
            == 0
        )
        out = capsys.readouterr().out
        assert out.splitlines()[0].split()[:2] == ["retried", "hotel"]
        assert "by alice" in out and "compensation-sent" in out
        assert f"saga {sid} is compensating; 1 command in the outbox" in out
        # The app's outbox relay sends the new cancellation; the participant answers it.
        await _until(app, "t-fail", "compensated", waiter)
        saga = await app.sagas.get(TripSaga, "t-fail")
        assert saga is not None
    assert desk.log.count(("cancel", "t-fail")) == 2
    retried = [t for t in saga.history if t.kind == "retried"]
    assert len(retried) == 1 and retried[0].by == "alice" and retried[0].step == "hotel"
    assert saga.history[-1].kind == "compensated"
    # Why it was compensated outlives the failed compensation and the retry.
    assert saga.reason == "flight rejected (clisaga.flight.rejected)"
    assert saga.history[-1].detail == saga.reason


async def test_skip_by_the_apps_saga_class(
    url: str,
    broker_url: str,
    waiter: Wait,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with _trips(url, broker_url, waiter) as (app, desk):
        # --app MODULE:APP: the class comes from the app's sagas= by the saga's name.
        other = App("trips-cli", broker="memory://", store=url, sagas=[TripSaga])
        monkeypatch.setattr(MODULE, "cli_app", other, raising=False)
        capsys.readouterr()
        sid = "saga-clisaga.trip-t-skip"
        argv = ["sagas", "skip", sid, "--by", "bob", "--app", f"{__name__}:cli_app"]
        assert await _cli(argv) == 0
        out = capsys.readouterr().out
        assert "skipped" in out and "by bob" in out
        assert out.splitlines()[-1] == f"saga {sid} is compensated"  # nothing older to undo
        saga = await app.sagas.get(TripSaga, "t-skip")
        assert saga is not None and saga.status == "compensated"
        skipped = [t for t in saga.history if t.kind == "skipped"]
        assert [(t.by, t.step) for t in skipped] == [("bob", "hotel")]
        assert saga.reason == "flight rejected (clisaga.flight.rejected)"
    assert desk.log.count(("cancel", "t-skip")) == 1  # skipped: not asked again


async def test_abort_a_running_saga(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _trips(url, broker_url, waiter) as (app, desk):
        desk.cancel_ok.add("t-wait")
        capsys.readouterr()
        sid = "saga-clisaga.trip-t-wait"
        argv = ["sagas", "abort", sid, "--by", "carol", "--reason", "customer called"]
        assert await _cli([*argv, "--store", url, "--saga", SAGA]) == 0
        out = capsys.readouterr().out
        assert "aborted" in out and "customer called" in out and "by carol" in out
        # Its flight is in flight: the abort waits for the flight's outcome (DESIGN 5).
        assert "is compensating" in out
        row = await app.sagas.find(sid)
        assert row is not None and row.status == "compensating"
        await app.publish(FlightRejected(trip_id="t-wait"), key="t-wait")
        await _until(app, "t-wait", "compensated", waiter)
        saga = await app.sagas.get(TripSaga, "t-wait")
        assert saga is not None and saga.reason == "customer called"
        aborted = [t for t in saga.history if t.kind == "aborted"]
        assert [(t.by, t.detail) for t in aborted] == [("carol", "customer called")]
    assert ("cancel", "t-wait") in desk.log


async def test_refusals_write_nothing(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _trips(url, broker_url, waiter) as (app, _):
        before = len(await app.sagas.history("saga-clisaga.trip-t-ok"))
        cases = [
            (["retry", "saga-clisaga.trip-t-ok"], 1, "is completed: only a failed saga"),
            (["skip", "saga-clisaga.trip-t-wait"], 1, "is running: only a failed saga"),
            (["abort", "saga-clisaga.trip-t-ok"], 1, "is completed: nothing to abort"),
            (["abort", "saga-clisaga.trip-t-fail"], 1, "retried or skipped"),
            (["retry", "saga-clisaga.trip-nope"], 1, "no saga 'saga-clisaga.trip-nope'"),
        ]
        for action, code, message in cases:
            capsys.readouterr()
            argv = ["sagas", *action, "--by", "dan", "--store", url, "--saga", SAGA]
            assert await _cli(argv) == code, action
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, (action, err)
        assert len(await app.sagas.history("saga-clisaga.trip-t-ok")) == before

        # Without the class there is no way to build the commands: say how to give it.
        capsys.readouterr()
        argv = ["sagas", "retry", "saga-clisaga.trip-t-fail", "--by", "dan", "--store", url]
        assert await _cli(argv) == 2
        assert "pass --saga MODULE:CLASS" in capsys.readouterr().err
        argv += ["--saga", f"{__name__}:PivotSaga"]
        assert await _cli(argv) == 2
        assert "declared with name='clisaga.pivot'" in capsys.readouterr().err
        argv[-1] = f"{__name__}:Desk"
        assert await _cli(argv) == 2
        assert "not a Saga class" in capsys.readouterr().err
        argv[-1] = f"{__name__}:Nope"
        assert await _cli(argv) == 2
        assert "Saga objects in it: PivotSaga, TripSaga" in capsys.readouterr().err
        assert await _status(app, "t-fail") == "failed"


async def test_retry_a_step_past_the_pivot(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    delivered = asyncio.Event()
    attempts: list[str] = []

    @subscribe(Pay.event_type, group="clisaga.pay")
    async def pay(cmd: Pay, ctx: Context) -> None:
        await ctx.publish(Paid(n=cmd.n))

    @subscribe(Deliver.event_type, group="clisaga.deliver")
    async def deliver(cmd: Deliver, ctx: Context) -> None:
        attempts.append(ctx.envelope.id)
        if delivered.is_set():
            await ctx.publish(Delivered(n=cmd.n))
        else:
            await ctx.publish(DeliveryFailed(n=cmd.n))

    app = App("pivots", broker=broker_url, store=url, handlers=[pay, deliver], sagas=[PivotSaga])
    async with app:
        await app.publish(Ordered(n="p-1"), key="p-1")

        async def failed() -> bool:
            saga = await app.sagas.get(PivotSaga, "p-1")
            return saga is not None and saga.status == "failed"

        await waiter(failed, what="p-1 out of its 2 attempts")
        sid = "saga-clisaga.pivot-p-1"
        capsys.readouterr()
        argv = ["sagas", "abort", sid, "--by", "erin", "--store", url, "--saga"]
        assert await _cli([*argv, f"{__name__}:PivotSaga"]) == 1
        assert "retried or skipped" in capsys.readouterr().err
        delivered.set()
        argv[1] = "retry"
        assert await _cli([*argv, f"{__name__}:PivotSaga"]) == 0
        out = capsys.readouterr().out
        assert "command-sent      deliver" in out and "(attempt 3)" in out

        async def completed() -> bool:
            saga = await app.sagas.get(PivotSaga, "p-1")
            return saga is not None and saga.status == "completed"

        await waiter(completed, what="p-1 completed after the retry")
        saga = await app.sagas.get(PivotSaga, "p-1")
        assert saga is not None
    assert len(attempts) == len(set(attempts)) == 3  # each attempt a new command id
    kinds = [t.kind for t in saga.history]
    assert "compensating" not in kinds  # past the pivot nothing is compensated
    assert kinds.count("retry-scheduled") == 1 and kinds[-1] == "completed"
    assert [t.by for t in saga.history if t.kind == "retried"] == ["erin"]


def test_by_is_required(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sagas", "retry", "saga-x-1", "--store", url])
    assert exc.value.code == 2
    assert "--by" in capsys.readouterr().err
    assert main(["sagas", "abort", "saga-x-1", "--by", " ", "--store", url]) == 2


# -- trace ---------------------------------------------------------------------------------


def _lines(out: str) -> list[tuple[int, str]]:
    """(depth, text) of each line of a trace, after its header."""
    return [((len(x) - len(x.lstrip())) // 2, x.strip()) for x in out.splitlines()[1:]]


def _find(lines: list[tuple[int, str]], *parts: str) -> int:
    hits = [i for i, (_, text) in enumerate(lines) if all(p in text for p in parts)]
    assert len(hits) == 1, (parts, lines)
    return hits[0]


def _parent(lines: list[tuple[int, str]], i: int) -> int:
    depth = lines[i][0]
    return next(j for j in range(i - 1, -1, -1) if lines[j][0] == depth - 1)


async def test_trace_shows_saga_transitions_in_the_causal_tree(
    url: str, broker_url: str, waiter: Wait, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _trips(url, broker_url, waiter) as (app, desk):
        desk.cancel_ok.add("t-fail")
        sid = "saga-clisaga.trip-t-fail"
        argv = ["sagas", "retry", sid, "--by", "alice", "--store", url, "--saga", SAGA]
        assert await _cli(argv) == 0
        await _until(app, "t-fail", "compensated", waiter)
        desk.crash_flight.add("t-crash")
        await app.publish(TripRequested(trip_id="t-crash"), key="t-crash")

        async def dead_lettered() -> bool:
            return bool(await app.store.dead_letters.list())

        await waiter(dead_lettered, what="the crashed flight command is dead-lettered")
        saga = await app.sagas.get(TripSaga, "t-fail")
        crashed = await app.sagas.get(TripSaga, "t-crash")
        assert saga is not None and crashed is not None
    history = saga.history
    correlation = history[0].message_id
    assert correlation is not None
    capsys.readouterr()
    assert await _cli(["trace", correlation, "--store", url]) == 0
    out = capsys.readouterr().out
    n = len(history)
    assert out.splitlines()[0] == (
        f"correlation {correlation}: {n} stored message(s), {n} of them saga transitions"
    )
    lines = _lines(out)
    assert sum(1 for _, text in lines if text.startswith("saga transition ")) == n
    # The start event is not stored: its transitions sit under a line naming it.
    started = _find(lines, "saga transition  started")
    assert lines[_parent(lines, started)][1] == (
        f"{correlation}  not stored: the message that started {sid}"
    )
    # The reply is nested under the command it answered, and what it caused under it.
    hotel = _find(lines, "command-sent hotel")
    replied = _find(lines, "replied hotel")
    assert _parent(lines, _parent(lines, replied)) == hotel
    assert "the answer to command" in lines[_parent(lines, replied)][1]
    flight = _find(lines, "command-sent flight")
    assert _parent(lines, _parent(lines, _find(lines, "rejected flight"))) == flight
    # The first cancellation timed out: its timer's transitions under that cancellation.
    first_cancel = _find(lines, "compensation-sent hotel", "(attempt 1)")
    timed_out = _find(lines, "timed-out hotel")
    assert _parent(lines, _parent(lines, timed_out)) == first_cancel
    assert lines[_parent(lines, timed_out)][1].startswith("the deadline of hotel passed")
    # alice's retry is an input of its own; the second cancellation's reply under it.
    retried = _find(lines, "saga transition  retried hotel", "by alice")
    person = _parent(lines, retried)
    assert lines[person] == (1, "alice ran `eventflow sagas retry` (no message)")
    second_cancel = _find(lines, "compensation-sent hotel", "(attempt 2)")
    assert _parent(lines, second_cancel) == person
    compensated = _find(lines, "saga transition  compensated hotel")
    assert _parent(lines, _parent(lines, compensated)) == second_cancel

    assert await _cli(["trace", correlation, "--store", url, "--json"]) == 0
    doc = orjson.loads(capsys.readouterr().out)
    marks = [m["saga_transition"] for m in doc["messages"]]
    assert [m["kind"] for m in sorted(marks, key=lambda m: m["version"])] == [
        t.kind for t in history
    ]
    sent = [m for m in marks if m["kind"] in ("command-sent", "compensation-sent")]
    assert len(sent) == 4 and all(m["command_id"] for m in sent)
    assert len({m["command_id"] for m in sent}) == 4  # a retry is a new command id

    # A participant's dead letter (caused by the flight command) nests under the transition
    # that sent the command.
    crash_correlation = crashed.history[0].message_id
    assert crash_correlation is not None
    assert await _cli(["trace", crash_correlation, "--store", url]) == 0
    lines = _lines(capsys.readouterr().out)
    letter = _find(lines, "DEAD LETTER of group clisaga.flight: RuntimeError: no seats")
    envelope = letter - 1  # a stored message is two lines: the envelope, then where
    assert lines[envelope][1].startswith("clisaga.flight.book v1")
    assert _parent(lines, envelope) == _find(lines, "command-sent flight")


# -- diagram ---------------------------------------------------------------------------------


def test_diagram_of_the_trip_saga(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sagas", "diagram", SAGA]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == diagram(TripSaga).splitlines()
    assert lines[0] == "stateDiagram-v2"
    edges = [line.strip() for line in lines if "-->" in line]
    assert edges == [
        "[*] --> step_hotel : TripRequested",
        "step_hotel --> step_flight : HotelBooked",
        "step_hotel --> undo_hotel : timeout 30s / abort (TripCancelled)",
        "step_flight --> completed : FlightBooked",
        "step_flight --> undo_hotel : FlightRejected / timeout 30s / abort (TripCancelled)",
        "undo_hotel --> compensated : HotelCancelled",
        "undo_hotel --> failed : timeout 3s",
        "completed --> [*]",
        "compensated --> [*]",
    ]
    assert '    state "cancel_hotel (undo hotel)" as undo_hotel' in lines
    assert any(line.startswith("    note right of failed") for line in lines)
    assert not any("pivot" in line for line in lines)


def test_diagram_marks_the_pivot_and_retries_after_it() -> None:
    lines = [line.strip() for line in diagram(PivotSaga).splitlines()]
    assert 'state "pay (pivot)" as step_pay' in lines
    assert "class step_pay pivot" in lines
    edges = [line for line in lines if "-->" in line]
    assert edges == [
        "[*] --> step_pay : Ordered",
        "step_pay --> step_note : Paid",
        "step_pay --> compensated : PayDeclined",
        "step_pay --> undo_pay : timeout 10s / abort",
        "step_note --> step_deliver : done (no reply)",
        "step_deliver --> completed : Delivered",
        "step_deliver --> step_deliver : DeliveryFailed / timeout 5s, retry",
        "step_deliver --> failed : 2 attempts spent",
        "undo_pay --> compensated : issued",
        "completed --> [*]",
        "compensated --> [*]",
    ]


def test_diagram_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sagas", "diagram", "no_colon"]) == 2
    assert "expected MODULE:SAGA" in capsys.readouterr().err
    assert main(["sagas", "diagram", f"{__name__}:Desk"]) == 2
    assert "not a Saga class" in capsys.readouterr().err
    assert main(["sagas", "diagram", "no_such_module_x:Saga"]) == 2
    assert "cannot import module 'no_such_module_x'" in capsys.readouterr().err
