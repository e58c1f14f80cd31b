"""``eventflow store init|read|tail``: create a store's schema, read streams or the global log,
follow new events live.

    eventflow store init --store postgresql://postgres@127.0.0.1/app
    eventflow store read order-o-1 --store sqlite:///shop.db      # one stream
    eventflow store read --all --after 100 --limit 20 --store ...  # the global log
    eventflow store tail --store ... [--after N]                   # follow (Ctrl-C stops)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator

import orjson

from ..errors import ConfigurationError
from ..ports import RecordedEvent, Store
from ..stores import store_for
from ._common import (
    EXIT_USAGE,
    STORE_ENV,
    CliError,
    add_log_level,
    add_target_options,
    check_limit,
    configure_logging,
    format_time,
    resolve_target,
    table,
)
from ._draw import terminal

__all__ = ["add_parser", "format_record"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``store`` subcommand and its actions."""
    parser = subparsers.add_parser(
        "store",
        help="create a store's schema, read streams and the global log, tail new events",
        description="Work with the event store of --store URL (or --app MODULE:APP).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    init = actions.add_parser("init", help="create the tables (also done on first use)")
    add_target_options(init)
    add_log_level(init, "WARNING")
    init.set_defaults(handler=_init)

    read = actions.add_parser("read", help="print one stream, or the global log with --all")
    read.add_argument("stream", nargs="?", help="the stream id, e.g. order-o-1")
    read.add_argument("--all", action="store_true", help="read the global log instead")
    read.add_argument("--after", type=int, default=0, help="global position to start after")
    read.add_argument("--backwards", action="store_true", help="newest first (one stream)")
    read.add_argument("--limit", type=int, default=None, help="at most this many events")
    read.add_argument("--json", action="store_true", help="one JSON object per line")
    add_target_options(read)
    add_log_level(read, "WARNING")
    read.set_defaults(handler=_read)

    tail = actions.add_parser("tail", help="print new events as they are appended")
    tail.add_argument("--after", type=int, default=None, help="start after this position")
    tail.add_argument("--json", action="store_true", help="one JSON object per line")
    add_target_options(tail)
    add_log_level(tail, "WARNING")
    tail.set_defaults(handler=_tail)


def format_record(rec: RecordedEvent, as_json: bool) -> str:
    """One line per event: position, stream@version, type vN, id, data (or a JSON object)."""
    env = rec.envelope
    if as_json:
        return orjson.dumps(
            {
                "position": rec.position,
                "stream_id": rec.stream_id,
                "stream_version": rec.stream_version,
                "envelope": env.to_dict(),
            },
            option=orjson.OPT_UTC_Z,
        ).decode()
    data = orjson.dumps(env.data).decode()
    return (
        f"{rec.position:>8}  {rec.stream_id}@{rec.stream_version}  {env.type} v{env.version}  "
        f"{env.id}  {data}"
    )


def _store(args: argparse.Namespace, *, create: bool = False) -> Store:
    if create and not args.app:
        url = args.store or os.environ.get(STORE_ENV)
        if not url:
            raise CliError(f"no store given: pass --store URL or set {STORE_ENV}", EXIT_USAGE)
        try:
            return store_for(url)
        except ConfigurationError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    return resolve_target(args).store


def _init(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    store = _store(args, create=True)

    async def run() -> None:
        await store.open()
        await store.close()

    asyncio.run(run())
    print(f"store ready: {store.url}")
    return 0


_PAGE = 200
"""Events per table drawn on a terminal: a long read shows as it goes, page by page."""


async def _print_all(store: Store, records: AsyncIterator[RecordedEvent], as_json: bool) -> int:
    count = 0
    drawn = not as_json and terminal()
    page: list[list[str]] = []
    await store.open()
    try:
        async for rec in records:
            count += 1
            if not drawn:
                print(format_record(rec, as_json), flush=True)
                continue
            page.append(_cells(rec))
            if len(page) == _PAGE:
                print(table(_HEADERS, page), flush=True)
                page = []
    finally:
        await store.close()
    if page:
        print(table(_HEADERS, page), flush=True)
    return count


_HEADERS = ["POSITION", "STREAM", "TYPE", "ID", "TIME", "DATA"]


def _cells(rec: RecordedEvent) -> list[str]:
    env = rec.envelope
    return [
        str(rec.position),
        f"{rec.stream_id}@{rec.stream_version}",
        f"{env.type} v{env.version}",
        env.id,
        format_time(env.time),
        orjson.dumps(env.data).decode(),
    ]


def _read(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if args.stream and args.all:
        raise CliError("give a stream id or --all, not both", EXIT_USAGE)
    if not args.stream and not args.all:
        raise CliError("say what to read: a stream id (e.g. order-o-1) or --all", EXIT_USAGE)
    check_limit("store read", args.limit, "the default: every event")
    store = _store(args)
    records = (
        store.read_all(after=args.after, limit=args.limit)
        if args.all
        else store.read_stream(args.stream, backwards=args.backwards, limit=args.limit)
    )
    count = asyncio.run(_print_all(store, records, args.json))
    if not count and args.stream:
        raise CliError(f"stream {args.stream!r} has no events", 1)
    if not count:
        print(f"(no events after position {args.after})", file=sys.stderr)
    return 0


def _tail(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    store = _store(args)

    async def run() -> None:
        await store.open()
        try:
            after = args.after if args.after is not None else await store.last_position()
            async for rec in store.subscribe(after=after):
                print(format_record(rec, args.json), flush=True)
        finally:
            await store.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        return 0
    return 0
