"""Consumer groups as the broker keeps them: where a new group begins, the log line of its
first start, and declaring an app's groups ahead of its first deploy.

A group that does not exist yet on the broker begins at ``start`` (see
:data:`~eventflow.ports.StartPosition`): at the end of its topics (``"latest"``, the
default) or at the oldest message the broker keeps (``"earliest"``). Once it exists it
keeps its position, whatever a later ``start`` says. ``eventflow groups declare MODULE:APP``
(:func:`declare_groups`) creates an app's groups without consuming, so commands sent to a
participant that never ran yet wait for it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import get_args

from .errors import ConfigurationError
from .patterns import validate_pattern
from .ports import Broker, StartPosition, declared

__all__ = [
    "DEFAULT_START",
    "START_POSITIONS",
    "GroupSpec",
    "GroupState",
    "check_group",
    "check_start",
    "declare_groups",
    "log_new_group",
]

DEFAULT_START: StartPosition = "latest"
START_POSITIONS: tuple[StartPosition, ...] = get_args(StartPosition)
_log = logging.getLogger("eventflow.groups")


def check_start(start: object) -> StartPosition:
    """``start`` if it is ``"latest"`` or ``"earliest"``; else a ``ConfigurationError``
    saying what each means."""
    if isinstance(start, str) and start in START_POSITIONS:
        return start
    raise ConfigurationError(
        f"start must be 'latest' or 'earliest', got {start!r}: where a group that does not "
        "exist yet begins, at the end of its topics ('latest', the default: only messages "
        "published from then on) or at the oldest message the broker keeps ('earliest')"
    )


def check_group(pattern: str, group: str, start: object) -> StartPosition:
    """``start``, once the arguments of a ``subscribe`` or ``declare`` are known to be valid
    (else a ``ConfigurationError``): a pattern, a non-empty group name and a start."""
    validate_pattern(pattern)
    if not group:
        raise ConfigurationError("a consumer group name must be non-empty")
    return check_start(start)


def log_new_group(group: str, pattern: str, start: StartPosition) -> None:
    """Log (INFO, logger ``eventflow.groups``) that ``group`` was just created on the broker
    for ``pattern`` and where it begins; adapters call it once, where they create it."""
    if start == "earliest":
        _log.info(
            "group %s is new: it begins at the oldest message kept on %s (start='earliest')",
            group,
            pattern,
        )
    else:
        _log.info(
            "group %s is new: it begins at the end of %s (start='latest'); messages "
            "published before now are not delivered to it (declare groups ahead with "
            "`eventflow groups declare MODULE:APP`, or subscribe with start='earliest')",
            group,
            pattern,
        )


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group an app subscribes: its name, its pattern and where it begins if new."""

    group: str
    pattern: str
    start: StartPosition = DEFAULT_START


@dataclass(frozen=True, slots=True)
class GroupState:
    """What :func:`declare_groups` found: ``existed`` before the call (with ``create``, a
    group that had not is created now)."""

    spec: GroupSpec
    existed: bool


async def declare_groups(
    broker: Broker, specs: Iterable[GroupSpec], *, create: bool = True
) -> AsyncIterator[GroupState]:
    """Ask ``broker`` (started) about each group with ``Broker.declare``, one at a time, in
    order, yielding each answer as it comes: with ``create`` it creates those that do not
    exist, at their ``start``, without consuming; without, it only looks. A ``BrokerError``
    ends the iteration at the group it was raised for."""
    declare = declared(broker, Broker, "declare")
    for spec in dict.fromkeys(specs):
        existed = await declare(spec.pattern, group=spec.group, start=spec.start, create=create)
        yield GroupState(spec, bool(existed))
