"""What ``eventflow status`` shows besides the instances: lag per consumer group (from the
broker, when one the command can reach is given) and per projection (from the store), and
the sagas by status.

A group's lag is asked of the broker for every ``group:pattern`` the running instances
report in their heartbeats (so ``--store`` with ``--broker`` is enough, without the app's
code), in messages and in seconds (the age of the oldest unhandled message). A projection's
lag is its checkpoint against the store's last position, in events and in seconds (the age
of the first event it has not handled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ..events import default_registry
from ..ports import Broker, Heartbeat, Store
from ..sagas.control import STATUSES
from ..sagas.runtime import Sagas
from ._common import Target, is_memory_broker

__all__ = [
    "GroupLag",
    "Overview",
    "ProjectionLag",
    "read_overview",
    "reported_projections",
    "stored_projections",
]

SAGA_COUNT_CAP = 10_000
"""Sagas counted per status at most (``>10000`` past it): the index is listed, not summed."""
LAG_TIMEOUT = 10.0


@dataclass(frozen=True, slots=True)
class GroupLag:
    """One consumer group on one pattern: unhandled messages and the oldest one's age."""

    group: str
    pattern: str
    messages: int | None
    seconds: float | None
    error: str = ""


@dataclass(frozen=True, slots=True)
class ProjectionLag:
    """One projection: events behind the store's last position and the first one's age."""

    name: str
    checkpoint: int
    events: int
    seconds: float | None


@dataclass(slots=True)
class Overview:
    """Lag, projections and sagas of one store (and broker)."""

    groups: list[GroupLag] = field(default_factory=list)
    groups_note: str = ""
    projections: list[ProjectionLag] = field(default_factory=list)
    sagas: dict[str, int] = field(default_factory=dict)
    sagas_note: str = ""


def subscriptions(beats: Sequence[Heartbeat]) -> list[tuple[str, str]]:
    """The ``(group, pattern)`` pairs the instances report, each once, sorted."""
    pairs = {sub.rpartition(":")[::2] for b in beats for sub in b.subscriptions if ":" in sub}
    return sorted(pairs)


async def read_overview(
    target: Target,
    beats: Sequence[Heartbeat],
    *,
    broker_given: bool,
    now: datetime,
    keep_broker: bool = False,
) -> Overview:
    """Read everything but the instances (the store is open). The broker is started here
    and closed after, unless ``keep_broker`` (``--watch`` asks it again every round in the
    same event loop, and a closed broker cannot start again): then the caller closes it."""
    out = Overview()
    # With --app, its code names its groups and projections too: every instance being down
    # (nothing in the heartbeats) is when their lag matters most.
    app = target.app
    own = () if app is None else tuple(p.name for p in app.projections)
    out.projections = await _projections(target.store, beats, now, own)
    out.sagas, out.sagas_note = await _sagas(target.store)
    pairs = subscriptions(beats)
    if app is not None:
        pairs = sorted(set(pairs) | {(s.group, s.pattern) for s in app.subscriptions})
    if not pairs:
        return out
    if not broker_given or is_memory_broker(target.broker):
        out.groups_note = (
            "group lag needs the broker: pass --broker URL (or --app MODULE:APP of an app on "
            "a network broker)"
        )
        return out
    try:
        await target.broker.start()
    except Exception as exc:  # the broker down is when status matters: report the rest
        error = f"{type(exc).__name__}: {exc}"
        if not keep_broker:
            await _close_quietly(target.broker)
        out.groups_note = f"cannot ask the broker for the groups' lag: {error}"
        out.groups = [GroupLag(group, pattern, None, None, error) for group, pattern in pairs]
        return out
    try:
        for group, pattern in pairs:
            try:
                async with asyncio.timeout(LAG_TIMEOUT):
                    lag = await target.broker.lag(pattern, group=group)
            except Exception as exc:  # one group's answer must not hide the others'
                error = f"{type(exc).__name__}: {exc}"
                out.groups.append(GroupLag(group, pattern, None, None, error))
                continue
            seconds = (
                lag.age(now) if lag.oldest is not None else (0.0 if not lag.messages else None)
            )
            out.groups.append(GroupLag(group, pattern, lag.messages, seconds))
    finally:
        if not keep_broker:
            await target.broker.close()
    return out


async def _close_quietly(broker: Broker) -> None:
    """Release what a broker that failed to start may hold; its own error was reported."""
    with contextlib.suppress(Exception):  # the start's error is the one to report
        await broker.close()


def reported_projections(beats: Sequence[Heartbeat]) -> set[str]:
    """The projections that running instances report problems for (``projection NAME:
    ...``): one failing on its first batch has no checkpoint yet, only these lines."""
    return {
        p.split(":", 1)[0].removeprefix("projection ")
        for b in beats
        for p in b.problems
        if p.startswith("projection ")
    }


async def stored_projections(
    store: Store, beats: Sequence[Heartbeat], also: Sequence[str] = ()
) -> dict[str, int]:
    """Every projection the store knows of, by name, with its checkpoint: those with a
    checkpoint row and those the instances report failing before their first (at 0), and
    the names in ``also`` (an app's projections, at 0 until they have a checkpoint)."""
    positions = dict(await store.checkpoints.list())
    for name in (*reported_projections(beats), *also):
        positions.setdefault(name, 0)
    return dict(sorted(positions.items()))


async def _projections(
    store: Store, beats: Sequence[Heartbeat], now: datetime, also: Sequence[str]
) -> list[ProjectionLag]:
    last = await store.last_position()
    out = []
    for name, position in (await stored_projections(store, beats, also)).items():
        seconds: float | None = 0.0
        if position < last:
            seconds = None
            async for rec in store.read_all(after=position, limit=1):
                seconds = max(0.0, (now - rec.envelope.time.astimezone(UTC)).total_seconds())
        out.append(ProjectionLag(name, position, max(0, last - position), seconds))
    return out


async def _sagas(store: Store) -> tuple[dict[str, int], str]:
    sagas = Sagas(store, default_registry, "eventflow-cli")
    counts: dict[str, int] = {}
    try:
        for status in STATUSES:
            n = len(await sagas.list(status=status, limit=SAGA_COUNT_CAP + 1))
            if n:
                counts[status] = n
    except Exception as exc:  # a read-only user cannot create the saga index: say so
        return {}, f"cannot read the saga index ({type(exc).__name__}: {exc})"
    return counts, ""
