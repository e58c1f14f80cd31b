"""``eventflow projections list|status|rebuild``: the projections of an app and their stores.

Projections are code, so they are found on the app (``--app MODULE:APP``, the app's
``projections``); their checkpoints live in the app's store. ``status`` without ``--app``
shows every checkpoint of a ``--store``.

``rebuild NAME`` takes the projection's lease (the one a running app holds while it runs the
projection), calls the projection's ``setup(tx)`` and ``reset(tx)``, deletes its checkpoint
and replays the whole log with a progress bar on stderr. It refuses if the lease is not free
within ``--lock-timeout`` seconds (a running app renews it for as long as it runs);
``--force`` waits for it instead (stop the app's instances, and the rebuild starts as soon as
the lease is released, or has expired after the app's lease ttl).

``status`` tells whether some instance runs each projection from the store's record of the
projection's lease (its holder, unless it expired); ``--lock-timeout`` bounds how long it
waits for the store to answer (the column shows ``?`` past it), 0 skips the lookup.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import orjson

from ..app import App
from ..ports import Heartbeat, Store
from ..projections import (
    Projection,
    ProjectionLockedError,
    ProjectionRunner,
    ProjectionStatus,
    lease_name,
)
from ._common import (
    EXIT_USAGE,
    CliError,
    add_log_level,
    add_target_options,
    configure_logging,
    load_app,
    resolve_target,
    table,
)
from ._draw import progress_for
from ._overview import stored_projections

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "ProgressBar",
    "add_parser",
    "app_projections",
    "command",
    "find_projection",
    "rebuild",
    "statuses",
]

DEFAULT_LOCK_TIMEOUT = 2.0
"""Seconds ``rebuild`` waits for a projection's lease (and ``status`` for the store to say
who holds it)."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``projections`` and its actions."""
    parser = subparsers.add_parser(
        "projections",
        help="list projections, show their lag, rebuild one",
        description="The projections of an app: list them, show their status, rebuild one.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = actions.add_parser("list", help="the app's projections and the event types they handle")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = actions.add_parser("status", help="checkpoint, store position, lag and running state")
    p.add_argument("names", nargs="*", metavar="NAME", help="only these projections")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=DEFAULT_LOCK_TIMEOUT,
        metavar="SECONDS",
        help="look up who holds each projection's lease, to tell if an app runs it, waiting "
        f"this long for the store (default: {DEFAULT_LOCK_TIMEOUT:g}; 0 to skip the lookup)",
    )

    p = actions.add_parser(
        "rebuild", help="drop a projection's state and replay the whole log into it"
    )
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "--force",
        action="store_true",
        help="if a running app holds the projection's lease, wait for it instead of refusing",
    )
    p.add_argument(
        "--lock-timeout",
        type=float,
        default=DEFAULT_LOCK_TIMEOUT,
        metavar="SECONDS",
        help="how long to wait for the projection's lease before refusing "
        f"(default: {DEFAULT_LOCK_TIMEOUT:g})",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, metavar="N", help="events per transaction"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    for sub in actions.choices.values():
        add_target_options(sub)
        add_log_level(sub, "WARNING")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run one ``projections`` action; return the exit code."""
    configure_logging(args.log_level)
    if args.action == "list":
        if not args.app:
            raise CliError("projections list needs --app MODULE:APP (projections are code)")
        app = load_app(args.app, args.app_dir)
        _print_list(app_projections(app), json=args.json)
        return 0
    if args.action == "rebuild" and not args.app:
        raise CliError(
            "projections rebuild needs --app MODULE:APP: the projection's code replays the log",
            EXIT_USAGE,
        )
    target = resolve_target(args)
    projections = app_projections(target.app) if target.app is not None else ()
    if args.action == "status":
        names = list(args.names)
        rows, errors = asyncio.run(_status(target.store, projections, names, args.lock_timeout))
        _print_status(rows, json=args.json, app=args.app, errors=errors)
        return 0
    projection = find_projection(projections, args.name)
    runner_options: dict[str, Any] = {}
    if args.batch_size is not None:
        runner_options["batch_size"] = args.batch_size
    if target.app is not None:
        runner_options["registry"] = target.app.registry
    bar = None if args.quiet else progress_for(sys.stderr, projection.name, ProgressBar)
    position = asyncio.run(
        _rebuild(target.store, projection, args.force, args.lock_timeout, bar, runner_options)
    )
    print(f"rebuilt projection {projection.name!r} up to position {position}")
    return 0


def app_projections(app: App) -> tuple[Projection, ...]:
    """The projections an app runs (``app.projections``)."""
    return tuple(app.projections)


def find_projection(projections: Sequence[Projection], name: str) -> Projection:
    """The projection called ``name``; ``CliError`` listing the known names otherwise."""
    for projection in projections:
        if projection.name == name:
            return projection
    known = ", ".join(sorted(p.name for p in projections)) or "none"
    raise CliError(
        f"the app has no projection named {name!r} (its projections: {known}); "
        "see `eventflow projections list --app MODULE:APP`",
        EXIT_USAGE,
    )


# -- list --------------------------------------------------------------------------------------


def _print_list(projections: Sequence[Projection], *, json: bool) -> None:
    if json:
        for p in projections:
            data = {"name": p.name, "class": type(p).__qualname__, "handles": p.handled_types()}
            print(orjson.dumps(data).decode())
        return
    if not projections:
        print("the app has no projections (App(..., projections=[MyProjection()]))")
        return
    rows = [
        [p.name, f"{type(p).__module__}.{type(p).__qualname__}", ", ".join(p.handled_types())]
        for p in projections
    ]
    print(table(["NAME", "CLASS", "HANDLES"], rows))


# -- status ------------------------------------------------------------------------------------


async def statuses(
    store: Store,
    projections: Sequence[Projection],
    names: Sequence[str] = (),
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    beats: Sequence[Heartbeat] = (),
) -> list[ProjectionStatus]:
    """Status of the app's projections (all, or ``names``) in an opened ``store``.

    Without projections (no ``--app``), every projection the store knows of is listed: its
    checkpoints, and those the instances' ``beats`` report failing before their first.
    ``lock_timeout`` > 0 looks up each projection's lease holder, waiting that long for
    the store (``running`` is None past it).
    """
    if not projections:
        known = await stored_projections(store, beats)
        for name in names:
            if name not in known:
                raise CliError(
                    f"the store has no projection named {name!r} (its projections: "
                    f"{', '.join(known) or 'none'}); a projection is known once it has a "
                    "checkpoint: pass --app MODULE:APP to ask for one that has not run yet",
                    EXIT_USAGE,
                )
        last = await store.last_position()
        return [
            ProjectionStatus(name, position, last, await _held(store, name, lock_timeout))
            for name, position in known.items()
            if not names or name in names
        ]
    if names:
        projections = [find_projection(projections, n) for n in names]
    out = []
    for projection in projections:
        runner = ProjectionRunner(projection, store)
        probe = lock_timeout if lock_timeout > 0 else None
        out.append(await runner.status(probe_lock=probe))
    return out


async def _held(store: Store, name: str, lock_timeout: float) -> bool | None:
    """Whether an instance holds projection ``name``'s lease, as the store records it (the
    lease is named after the projection, so no code is needed); None when not looked up
    (``lock_timeout`` 0) or the store did not answer within it."""
    if lock_timeout <= 0:
        return None
    try:
        async with asyncio.timeout(lock_timeout):
            return await store.leases.holder(lease_name(name)) is not None
    except TimeoutError:
        return None


async def _status(
    store: Store, projections: Sequence[Projection], names: Sequence[str], lock_timeout: float
) -> tuple[list[ProjectionStatus], dict[str, list[str]]]:
    await store.open()
    try:
        beats = await store.heartbeats.list()
        rows = await statuses(store, projections, names, lock_timeout, beats)
        return rows, failing(beats, [r.name for r in rows])
    finally:
        await store.close()


def failing(beats: Sequence[Heartbeat], names: Sequence[str]) -> dict[str, list[str]]:
    """Per projection name, the problem lines running instances report for it (its last
    error, the event it fails on and since when), from their heartbeats."""
    out: dict[str, list[str]] = {}
    for beat in beats:
        for problem in beat.problems:
            for name in names:
                if problem.startswith(f"projection {name}:"):
                    out.setdefault(name, []).append(f"{beat.instance}: {problem}")
    return out


def _print_status(
    rows: Sequence[ProjectionStatus],
    *,
    json: bool,
    app: str | None = None,
    errors: dict[str, list[str]] | None = None,
) -> None:
    errors = errors or {}
    if json:
        for s in rows:
            data = {
                "name": s.name,
                "checkpoint": s.checkpoint,
                "last_position": s.last_position,
                "lag": s.lag,
                "running": s.running,
                "problems": errors.get(s.name, []),
            }
            print(orjson.dumps(data).decode())
        return
    if not rows:
        if app:
            print(f"the app {app} has no projections (App(..., projections=[MyProjection()]))")
        else:
            print(
                "no projection checkpoint is stored yet (no projection has run against this "
                "store); pass --app MODULE:APP to list an app's projections before they run"
            )
        return
    running = {True: "yes", False: "no", None: "?"}
    table_rows = [
        [s.name, str(s.checkpoint), str(s.last_position), str(s.lag), running[s.running]]
        for s in rows
    ]
    print(table(["NAME", "CHECKPOINT", "LAST POSITION", "LAG", "RUNNING"], table_rows))
    for s in rows:
        for line in errors.get(s.name, []):
            print(f"  {line}")


# -- rebuild -----------------------------------------------------------------------------------


class ProgressBar:
    """A one-line progress bar redrawn with ``\\r`` (at most every ``interval`` seconds)."""

    def __init__(
        self, stream: TextIO, label: str, *, width: int = 30, interval: float = 0.1
    ) -> None:
        self.stream = stream
        self.label = label
        self.width = width
        self.interval = interval
        self._started = time.monotonic()
        self._drawn = float("-inf")
        self._last: tuple[int, int] | None = None
        self._shown: tuple[int, int] | None = None

    def __call__(self, position: int, end: int) -> None:
        """Record progress; redraw if ``interval`` has passed or the end is reached."""
        self._last = (position, end)
        now = time.monotonic()
        if position >= end or now - self._drawn >= self.interval:
            self._drawn = now
            self._draw(position, end, now)

    def _draw(self, position: int, end: int, now: float) -> None:
        self._shown = (position, end)
        fraction = 1.0 if end <= 0 else min(1.0, position / end)
        filled = int(fraction * self.width)
        elapsed = max(now - self._started, 1e-9)
        rate = position / elapsed
        self.stream.write(
            f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{fraction * 100:5.1f}% {position:,}/{end:,} events {rate:,.0f} ev/s"
        )
        self.stream.flush()

    def finish(self) -> None:
        """Draw the final state and end the line."""
        if self._last is not None:
            if self._shown != self._last:
                self._draw(*self._last, time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


async def rebuild(
    store: Store,
    projection: Projection,
    *,
    force: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    progress: ProgressBar | None = None,
    **runner_options: Any,
) -> int:
    """Rebuild ``projection`` in an opened ``store``; return the last position replayed.

    Refuses (``CliError``) if the projection's lease stays held for ``lock_timeout`` seconds,
    unless ``force``: then it says so on stderr and waits for the lease.
    """
    runner = ProjectionRunner(projection, store, **runner_options)
    try:
        try:
            return await runner.rebuild(progress=progress, lock_timeout=lock_timeout)
        except ProjectionLockedError as exc:
            if not force:
                raise CliError(
                    f"{exc}. Rebuilding under a running projection would mix old and new "
                    "state: stop the app first (or pass --force to wait for the lease)"
                ) from None
            print(
                f"projection {projection.name!r} is running in an app; waiting for its lease "
                "(stop the app; Ctrl-C to give up)",
                file=sys.stderr,
            )
            return await runner.rebuild(progress=progress)
    finally:
        if progress is not None:
            progress.finish()


async def _rebuild(
    store: Store,
    projection: Projection,
    force: bool,
    lock_timeout: float,
    progress: ProgressBar | None,
    runner_options: dict[str, Any],
) -> int:
    await store.open()
    try:
        return await rebuild(
            store,
            projection,
            force=force,
            lock_timeout=lock_timeout,
            progress=progress,
            **runner_options,
        )
    finally:
        await store.close()
