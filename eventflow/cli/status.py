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
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from ..ports import Heartbeat
from ..runtime.heartbeat import DEFAULT_HEARTBEAT_INTERVAL
from ._common import (
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
    add_target_options(parser)
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
    """Print the status of the store named on the command line; return the exit code."""
    configure_logging(args.log_level)
    target = resolve_target(args)
    beats, counts = asyncio.run(_read(target, args.stale if args.prune else None))
    now = datetime.now(UTC)
    if args.json:
        print(orjson.dumps(_as_json(beats, counts, now, args.stale)).decode())
    else:
        print(
            render(
                beats,
                counts,
                now=now,
                stale_after=args.stale,
                where=target.description,
                again=target.again,
            )
        )
    return 0


async def _read(
    target: Target, prune_after: float | None = None
) -> tuple[list[Heartbeat], dict[str, int]]:
    await target.store.open()
    try:
        if prune_after is not None:
            await target.store.heartbeats.prune(prune_after)
        beats = await target.store.heartbeats.list()
        counts = await target.dead_letters.count()
    finally:
        await target.store.close()
    return beats, counts


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
