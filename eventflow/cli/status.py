"""``eventflow status``: running app instances (from their heartbeats) and DLQ sizes.

Every running app writes a heartbeat row every few seconds and deletes it on a clean
shutdown; a row older than ``--stale`` seconds belongs to an instance that stopped without
cleaning up (killed, crashed) or is stuck, and is marked ``stale``. An instance whose
components are being restarted after failures is ``DEGRADED``; one with a component that
cannot recover is ``FAILED`` (an app that stopped because of it leaves that last heartbeat),
each with a line per component saying what failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from ..ports import Heartbeat
from ..runtime.heartbeat import DEFAULT_HEARTBEAT_INTERVAL
from ._common import (
    BROKER_ENV,
    EXIT_USAGE,
    CliError,
    Target,
    add_log_level,
    add_target_options,
    configure_logging,
    format_age,
    format_time,
    indent,
    resolve_target,
    table,
)
from ._overview import SAGA_COUNT_CAP, Overview, read_overview

__all__ = ["DEFAULT_STALE_AFTER", "add_parser", "command", "format_stats", "render"]

DEFAULT_STALE_AFTER = 3 * DEFAULT_HEARTBEAT_INTERVAL
"""Seconds without a heartbeat after which an instance is shown as stale."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``status`` subcommand."""
    parser = subparsers.add_parser(
        "status",
        help="show running app instances and dead-letter counts",
        description=(
            "Show the app instances that heartbeat into a store (app, instance, last seen, "
            "age, subscriptions, counters) and the dead letters per consumer group."
        ),
    )
    add_target_options(parser, broker=True)
    parser.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="redraw every SECONDS until Ctrl-C",
    )
    parser.add_argument(
        "--stale",
        type=float,
        default=DEFAULT_STALE_AFTER,
        metavar="SECONDS",
        help=f"mark instances silent this long as stale (default: {DEFAULT_STALE_AFTER:g})",
    )
    parser.add_argument(
        "--prune",
        action="store_true",
        help="delete the heartbeats of stale instances (crashed or killed) before showing",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_log_level(parser, "WARNING")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Print the status of the store named on the command line (again every ``--watch``
    seconds until Ctrl-C); return the exit code."""
    configure_logging(args.log_level)
    if args.watch is not None and args.watch <= 0:
        raise CliError(f"--watch takes a number of seconds > 0, got {args.watch:g}", EXIT_USAGE)
    target = resolve_target(args)
    broker_given = bool(args.app or args.broker or os.environ.get(BROKER_ENV))
    if args.watch is None:
        asyncio.run(_show(args, target, broker_given))
        return 0
    try:
        asyncio.run(_watch(args, target, broker_given))
    except KeyboardInterrupt:
        return 0  # the way to stop watching
    return 0


async def _watch(args: argparse.Namespace, target: Target, broker_given: bool) -> None:
    """Every round in one event loop, with one broker connection for all of them (a broker
    closed after a round cannot start again)."""
    redraw = sys.stdout.isatty()
    try:
        while True:
            if redraw:
                print("\x1b[H\x1b[2J", end="")  # home, clear: the report in place
            await _show(args, target, broker_given, keep_broker=True)
            if not redraw:
                print(flush=True)
            await _nap(args.watch)
    finally:
        with contextlib.suppress(Exception):  # what was shown is what matters
            await target.broker.close()


async def _nap(seconds: float) -> None:
    """The pause between two ``--watch`` rounds."""
    await asyncio.sleep(seconds)


async def _show(
    args: argparse.Namespace, target: Target, broker_given: bool, *, keep_broker: bool = False
) -> None:
    now = datetime.now(UTC)
    beats, counts, overview = await _read(
        target, args.stale if args.prune else None, broker_given, now, keep_broker
    )
    if args.json:
        data = _as_json(beats, counts, now, args.stale)
        data.update(_overview_json(overview))
        print(orjson.dumps(data).decode(), flush=True)
        return
    text = render(
        beats, counts, now=now, stale_after=args.stale, where=target.description, again=target.again
    )
    more = render_overview(overview)
    print(text + ("\n" + more if more else ""), flush=True)


async def _read(
    target: Target,
    prune_after: float | None,
    broker_given: bool,
    now: datetime,
    keep_broker: bool = False,
) -> tuple[list[Heartbeat], dict[str, int], Overview]:
    await target.store.open()
    try:
        if prune_after is not None:
            await target.store.heartbeats.prune(prune_after)
        beats = await target.store.heartbeats.list()
        counts = await target.dead_letters.count()
        overview = await read_overview(
            target, beats, broker_given=broker_given, now=now, keep_broker=keep_broker
        )
    finally:
        await target.store.close()
    return beats, counts, overview


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}s"


def render_overview(overview: Overview) -> str:
    """The lag per group and projection and the sagas by status, as text sections."""
    lines: list[str] = []
    if overview.groups or overview.groups_note:
        lines += ["", "consumer groups:"]
        if overview.groups_note:
            lines.append(f"  ({overview.groups_note})")
        rows = [
            [
                g.group,
                g.pattern,
                "?" if g.messages is None else str(g.messages),
                _seconds(g.seconds),
            ]
            # one error for every group (the broker is unreachable) is the note above
            + ([g.error] if g.error and not overview.groups_note else [""])
            for g in overview.groups
        ]
        if rows:
            lines.append(indent(table(["GROUP", "PATTERN", "LAG", "OLDEST", ""], rows)))
    if overview.projections:
        lines += ["", "projections:"]
        rows = [
            [p.name, str(p.checkpoint), str(p.events), _seconds(p.seconds)]
            for p in overview.projections
        ]
        lines.append(indent(table(["NAME", "CHECKPOINT", "LAG", "OLDEST"], rows)))
    if overview.sagas:
        cap = SAGA_COUNT_CAP
        parts = [f"{k}={'>' + str(cap) if v > cap else v}" for k, v in overview.sagas.items()]
        lines += ["", f"sagas: {' '.join(parts)}"]
    if overview.sagas_note:
        lines += ["", f"sagas: {overview.sagas_note}"]
    return "\n".join(lines)


def _overview_json(overview: Overview) -> dict[str, Any]:
    return {
        "groups": [
            {
                "group": g.group,
                "pattern": g.pattern,
                "lag_messages": g.messages,
                "lag_seconds": g.seconds,
                **({"error": g.error} if g.error else {}),
            }
            for g in overview.groups
        ],
        "projections": [
            {
                "name": p.name,
                "checkpoint": p.checkpoint,
                "lag_events": p.events,
                "lag_seconds": p.seconds,
            }
            for p in overview.projections
        ],
        "sagas": dict(overview.sagas),
    }


def format_stats(stats: Mapping[str, int]) -> str:
    """``handled=10 duplicates=2``: the non-zero counters (``-`` when all are zero)."""
    parts = [f"{k}={v}" for k, v in stats.items() if v]
    return " ".join(parts) or "-"


def render(
    beats: list[Heartbeat],
    counts: Mapping[str, int],
    *,
    now: datetime,
    stale_after: float = DEFAULT_STALE_AFTER,
    where: str = "",
    again: str = "",
) -> str:
    """The human-readable status report; ``again`` is the options that name the store in
    the hints (``--store URL``), empty when it came from ``$EVENTFLOW_STORE``."""
    lines: list[str] = []
    live = sum(1 for b in beats if not _is_stale(b, now, stale_after))
    header = f"app instances: {live} running"
    if len(beats) > live:
        header += f", {len(beats) - live} stale"
    unwell = [b for b in beats if b.health != "ok"]
    if unwell:
        header += f", {len(unwell)} unhealthy"
    lines.append(header + (f" ({where})" if where else ""))
    if beats:
        ordered = sorted(beats, key=lambda b: (b.app, b.instance))
        rows = [
            [
                b.app,
                b.instance,
                b.health.upper() if b.health != "ok" else "ok",
                format_time(b.last_seen),
                format_age(b.last_seen, now) + (" stale" if _is_stale(b, now, stale_after) else ""),
                _subscriptions_cell(b.subscriptions),
                format_stats(b.stats),
            ]
            for b in ordered
        ]
        headers = ["APP", "INSTANCE", "HEALTH", "LAST SEEN", "AGE", "SUBSCRIPTIONS", "STATS"]
        lines.append(indent(table(headers, rows)))
        for b in ordered:
            for problem in b.problems:
                lines.append(f"  {b.instance}: {problem}")
        for b in ordered:
            if len(b.subscriptions) > _SHOWN_SUBSCRIPTIONS:
                lines.append(f"  {b.instance} subscribes to {len(b.subscriptions)}:")
                lines.extend(f"    {name}" for name in b.subscriptions)
    else:
        lines.append("  (none: no app is running against this store)")
    total = sum(counts.values())
    lines.append("")
    lines.append(f"dead letters: {total}")
    if counts:
        rows = [[group, str(n)] for group, n in sorted(counts.items())]
        lines.append(indent(table(["GROUP", "COUNT"], rows)))
        lines.append(f"  inspect them with: eventflow dlq list{' ' + again if again else ''}")
    return "\n".join(lines)


_SHOWN_SUBSCRIPTIONS = 2
"""Subscriptions named in the table's cell; more are listed one a line under the table."""


def _subscriptions_cell(subscriptions: tuple[str, ...] | list[str]) -> str:
    if not subscriptions:
        return "-"
    if len(subscriptions) <= _SHOWN_SUBSCRIPTIONS:
        return ", ".join(subscriptions)
    shown = ", ".join(subscriptions[:_SHOWN_SUBSCRIPTIONS])
    return f"{shown} +{len(subscriptions) - _SHOWN_SUBSCRIPTIONS} more"


def _is_stale(beat: Heartbeat, now: datetime, stale_after: float) -> bool:
    return (now - beat.last_seen).total_seconds() > stale_after


def _as_json(
    beats: list[Heartbeat], counts: Mapping[str, int], now: datetime, stale_after: float
) -> dict[str, Any]:
    return {
        "instances": [
            {
                "app": b.app,
                "instance": b.instance,
                "host": b.host,
                "pid": b.pid,
                "started_at": b.started_at.isoformat(),
                "last_seen": b.last_seen.isoformat(),
                "age_seconds": round((now - b.last_seen).total_seconds(), 3),
                "stale": _is_stale(b, now, stale_after),
                "subscriptions": list(b.subscriptions),
                "stats": dict(b.stats),
                "health": b.health,
                "problems": list(b.problems),
            }
            for b in beats
        ],
        "dead_letters": dict(counts),
    }
