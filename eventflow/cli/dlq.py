"""``eventflow dlq list|show|replay|purge``: the dead-letter queue of a store.

Listing, showing and purging read and write the store only. Replaying republishes the
original bytes, so it needs the broker the consumers read: a network broker (``--broker``
or the ``--app``'s broker). The ``memory://`` broker lives inside the app's process, so a
replay from here could reach nobody; the command says so and points at
``app.dead_letters.replay()``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import orjson

from ..errors import DeadLetterNotFound
from ..ports import DeadLetter
from ._common import (
    EXIT_USAGE,
    CliError,
    Target,
    add_log_level,
    add_target_options,
    check_limit,
    configure_logging,
    format_time,
    indent,
    is_memory_broker,
    resolve_target,
    table,
)

__all__ = ["add_parser", "command", "letter_as_dict"]

_ERROR_WIDTH = 60
_ALL = 1_000_000  # "every letter" for list(limit=...)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``dlq`` and its actions."""
    parser = subparsers.add_parser(
        "dlq",
        help="list, show, replay or purge dead letters",
        description="Inspect and act on the dead letters kept in a store.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = actions.add_parser("list", help="list dead letters, oldest first")
    p.add_argument("--group", help="only this consumer group's letters")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default: 100)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = actions.add_parser("show", help="show one dead letter in full")
    p.add_argument("id", metavar="ID", help="the letter's id, or a prefix only it has")
    p.add_argument("--json", action="store_true", help="print it as a JSON object")

    p = actions.add_parser(
        "replay", help="republish letters to their topic for their group, then delete them"
    )
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="replay every letter")

    p = actions.add_parser("purge", help="delete dead letters")
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="delete every letter")

    for name, sub in actions.choices.items():
        add_target_options(sub, broker=name == "replay")
        add_log_level(sub, "WARNING")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run one ``dlq`` action; return the exit code."""
    configure_logging(args.log_level)
    if args.action in ("replay", "purge") and bool(args.ids) == bool(args.all):
        what = "not both" if args.all else "neither was given"
        raise CliError(
            f"dlq {args.action}: name the letters (IDs from `eventflow dlq list`) or pass "
            f"--all ({what})",
            EXIT_USAGE,
        )
    if args.action == "list":
        check_limit("dlq list", args.limit, "the default is 100")
    target = resolve_target(args)
    if args.action == "replay" and is_memory_broker(target.broker):
        raise CliError(_MEMORY_REPLAY, EXIT_USAGE)
    return asyncio.run(_run(args, target))


_MEMORY_REPLAY = (
    "cannot replay over the memory:// broker from the command line: the in-memory broker "
    "lives inside the app's process, so messages published from here would reach no "
    "consumer. Either use a network broker (pass --app MODULE:APP for an app on nats:// or "
    "kafka://, or --broker URL), or replay from code inside the running app: "
    "`await app.dead_letters.replay(ids)`"
)


async def _run(args: argparse.Namespace, target: Target) -> int:
    await target.store.open()
    try:
        if args.action == "list":
            return await _list(args, target)
        if args.action == "show":
            return await _show(args, target)
        if args.action == "purge":
            ids = None if args.all else [await _resolve(target, i) for i in args.ids]
            n = await target.dead_letters.purge(ids)
            print(f"purged {n} dead letter{'s' if n != 1 else ''}")
            return 0
        return await _replay(args, target)
    finally:
        await target.store.close()


async def _list(args: argparse.Namespace, target: Target) -> int:
    letters = await target.dead_letters.list(group=args.group, limit=args.limit)
    if args.json:
        for letter in letters:
            print(orjson.dumps(letter_as_dict(letter, full=False)).decode())
        return 0
    if not letters:
        print(f"no dead letters in {target.description}")
        return 0
    rows = [
        [
            d.id,
            d.group,
            d.topic,
            d.reason,
            str(d.attempts),
            format_time(d.failed_at),
            _first_line(d.error),
        ]
        for d in letters
    ]
    print(table(["ID", "GROUP", "TOPIC", "REASON", "ATTEMPTS", "FAILED AT", "ERROR"], rows))
    return 0


async def _show(args: argparse.Namespace, target: Target) -> int:
    letter = await target.dead_letters.get(await _resolve(target, args.id))
    data = letter_as_dict(letter, full=True)
    if args.json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return 0
    for name in ("id", "group", "topic", "key", "reason", "attempts", "failed_at", "envelope_id"):
        print(f"{name + ':':<13}{data[name] if data[name] is not None else '-'}")
    print(f"{'headers:':<13}{orjson.dumps(data['headers']).decode()}")
    print(f"{'source:':<13}{orjson.dumps(data['source']).decode()}")
    print("error:")
    for line in letter.error.rstrip().splitlines():
        print(f"  {line}")
    print(f"payload ({len(letter.payload)} bytes):")
    print(indent(_render_payload(letter.payload)))
    return 0


async def _replay(args: argparse.Namespace, target: Target) -> int:
    if args.all:
        ids = [d.id for d in await target.dead_letters.list(limit=_ALL)]
    else:
        ids = [await _resolve(target, i) for i in args.ids]  # unknown ids fail here
    if not ids:
        print("no dead letters to replay")
        return 0
    # Only now the broker: bounded by its connect timeout, and not needed for nothing.
    await target.broker.start()
    try:
        n = await target.dead_letters.replay(ids)
    finally:
        await target.broker.close()
    print(f"replayed {n} dead letter{'s' if n != 1 else ''}")
    return 0


_AMBIGUOUS_SHOWN = 5


async def _resolve(target: Target, given: str) -> str:
    """The id of the one letter whose id is ``given`` or starts with it (as git takes a
    commit's prefix); ``DeadLetterNotFound`` when none does, ``CliError`` naming the
    candidates when several do."""
    try:
        return (await target.dead_letters.get(given)).id
    except DeadLetterNotFound:
        if not given:
            raise
        found = [d.id for d in await target.dead_letters.list(limit=_ALL) if d.id.startswith(given)]
        if len(found) == 1:
            return found[0]
        if not found:
            raise
    shown = ", ".join(found[:_AMBIGUOUS_SHOWN]) + (", ..." if len(found) > _AMBIGUOUS_SHOWN else "")
    raise CliError(
        f"dead-letter id prefix {given!r} is ambiguous: {len(found)} letters start with it "
        f"({shown}); give more of the id"
    )


def letter_as_dict(letter: DeadLetter, *, full: bool) -> dict[str, Any]:
    """A JSON-ready view of a letter; ``full`` adds the payload and the whole error text."""
    data: dict[str, Any] = {
        "id": letter.id,
        "group": letter.group,
        "topic": letter.topic,
        "key": letter.key,
        "reason": letter.reason,
        "attempts": letter.attempts,
        "failed_at": letter.failed_at.isoformat(),
        "envelope_id": letter.envelope_id,
        "error": letter.error if full else _first_line(letter.error, width=None),
    }
    if full:
        data["headers"] = dict(letter.headers)
        data["source"] = dict(letter.source)
        data["payload"] = letter.payload.decode("utf-8", errors="backslashreplace")
    return data


def _first_line(text: str, width: int | None = _ERROR_WIDTH) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    if width is not None and len(line) > width:
        return line[: width - 3] + "..."
    return line


def _render_payload(payload: bytes) -> str:
    try:
        return orjson.dumps(orjson.loads(payload), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        return repr(payload)
