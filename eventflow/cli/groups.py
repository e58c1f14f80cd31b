"""``eventflow groups declare|list MODULE:APP``: an app's consumer groups on its broker.

A group that does not exist yet begins where its ``@subscribe(..., start=...)`` says, at
the end of its topics by default, so a command sent to a participant that never ran is
not delivered to it. ``declare`` creates the app's groups (its handlers' and its sagas')
ahead of its first deploy, without consuming, so such commands wait for it; ``list`` only
looks. Both need a network broker: the ``memory://`` broker lives inside the app's
process.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import orjson

from ..app import App
from ..brokers import open_broker
from ..errors import ConfigurationError
from ..groups import GroupState, declare_groups
from ..ports import Broker
from ._common import (
    BROKER_ENV,
    EXIT_USAGE,
    CliError,
    add_log_level,
    configure_logging,
    is_memory_broker,
    load_app,
    table,
)

__all__ = ["add_parser", "command", "state_as_dict"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``groups`` and its actions."""
    parser = subparsers.add_parser(
        "groups",
        help="declare or list an app's consumer groups on its broker",
        description=(
            "An app's consumer groups (its handlers' and its sagas') on its broker. A group "
            "that does not exist yet begins at its start= (the end of its topics by "
            "default), so declare the groups of a participant before anything sends it "
            "commands."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser(
        "declare",
        help="create the app's groups that do not exist yet, without consuming",
    )
    actions.add_parser("list", help="the app's groups and whether each exists on the broker")
    for sub in actions.choices.values():
        sub.add_argument("apps", nargs="+", metavar="MODULE:APP", help="e.g. shop.inventory:app")
        sub.add_argument(
            "--app-dir", default=".", metavar="DIR", help="where to import from (default: .)"
        )
        sub.add_argument(
            "--broker",
            metavar="URL",
            help=f"use this broker instead of the app's (default: ${BROKER_ENV}, else the app's)",
        )
        sub.add_argument("--json", action="store_true", help="one JSON object per group and line")
        add_log_level(sub, "WARNING")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run ``groups declare`` or ``groups list``; return the exit code."""
    configure_logging(args.log_level)
    apps = [load_app(spec, args.app_dir) for spec in args.apps]
    url = args.broker or os.environ.get(BROKER_ENV)
    targets: list[tuple[App, Broker]] = []
    for app in apps:
        try:
            broker = open_broker(url) if url else app.broker
        except ConfigurationError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
        if is_memory_broker(broker):
            raise CliError(_MEMORY, EXIT_USAGE)
        targets.append((app, broker))
    return asyncio.run(_run(args, targets))


_MEMORY = (
    "the memory:// broker lives inside the app's process, so its groups exist only while "
    "that process runs and cannot be declared from here. Give the app a network broker "
    "(nats:// or kafka://, or pass --broker URL), or, in one process, start the "
    "participants before anything sends them commands (or subscribe them with "
    "start='earliest')"
)


async def _run(args: argparse.Namespace, targets: list[tuple[App, Broker]]) -> int:
    create = args.action == "declare"
    for app, broker in targets:
        if not args.json:
            print(f"app {app.name} on {broker.url}:")
        await broker.start()
        states: list[GroupState] = []
        try:
            async for state in declare_groups(broker, app.subscriptions, create=create):
                states.append(state)
                if args.json:
                    print(orjson.dumps(state_as_dict(app.name, state, create=create)).decode())
        finally:
            if not args.json:
                _print_table(states, create=create)
            await broker.close()
    return 0


def _print_table(states: list[GroupState], *, create: bool) -> None:
    if not states:
        print("  no groups: the app has no handlers or sagas")
        return
    rows = [
        [s.spec.group, s.spec.pattern, s.spec.start, _outcome(s, create=create)] for s in states
    ]
    header = "RESULT" if create else "ON THE BROKER"
    for line in table(["GROUP", "PATTERN", "START", header], rows).splitlines():
        print(f"  {line}")
    existed = sum(s.existed for s in states)
    if create:
        print(f"  created {len(states) - existed}, already existed {existed}")
    else:
        missing = len(states) - existed
        print(f"  exist {existed}, missing {missing}")
        if missing:
            print(
                "  missing groups begin at START when the app first runs; declare creates them now"
            )


def _outcome(state: GroupState, *, create: bool) -> str:
    if create:
        return "already existed" if state.existed else "created"
    return "exists" if state.existed else "missing"


def state_as_dict(app: str, state: GroupState, *, create: bool) -> dict[str, object]:
    """A JSON-ready view of one group: ``app``, ``group``, ``pattern``, ``start``,
    ``existed`` (before the command) and, for ``declare``, ``created``."""
    data: dict[str, object] = {
        "app": app,
        "group": state.spec.group,
        "pattern": state.spec.pattern,
        "start": state.spec.start,
        "existed": state.existed,
    }
    if create:
        data["created"] = not state.existed
    return data
