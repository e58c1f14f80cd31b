"""``eventflow trace CORRELATION_ID``: the causal tree of one business transaction.

Every envelope carries the ``correlation_id`` of the transaction it belongs to and the
``causation_id`` of the message whose handling produced it. This command gathers what the
store keeps of one correlation — events appended to the event store, dead letters and
messages still waiting in the outbox — and prints them as a tree, each under its cause.
Messages that only ever travelled through the broker are not stored, so they appear only as
the (missing) causes of what is.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field

import orjson

from ..envelope import Envelope
from ..errors import DecodeError
from ..ports import Store
from ._common import (
    CliError,
    add_log_level,
    add_target_options,
    configure_logging,
    format_time,
    resolve_target,
)

__all__ = ["Node", "add_parser", "collect", "render"]


@dataclass(slots=True)
class Node:
    """One message of the trace and where it was found."""

    envelope: Envelope
    where: str
    children: list[Node] = field(default_factory=list)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``trace`` subcommand."""
    parser = subparsers.add_parser(
        "trace",
        help="print the causal tree of one correlation id",
        description=(
            "Gather the stored events, dead letters and outbox messages of one correlation "
            "id and print them as a tree (each message under the one that caused it)."
        ),
    )
    parser.add_argument("correlation_id", metavar="CORRELATION_ID")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_target_options(parser)
    add_log_level(parser, "WARNING")
    parser.set_defaults(handler=command)


async def collect(store: Store, correlation_id: str) -> list[Node]:
    """Every stored message of ``correlation_id`` (event log, dead letters, outbox)."""
    nodes: list[Node] = []
    async for rec in store.read_all(after=0):
        if rec.envelope.correlation_id == correlation_id:
            where = f"store {rec.stream_id}@{rec.stream_version} (position {rec.position})"
            nodes.append(Node(rec.envelope, where))
    for letter in await store.dead_letters.list(limit=1_000_000):
        try:
            env = Envelope.from_bytes(letter.payload)
        except DecodeError:
            continue
        if env.correlation_id == correlation_id:
            first_line = letter.error.splitlines()[0] if letter.error else ""
            nodes.append(Node(env, f"DEAD LETTER of group {letter.group}: {first_line}"))
    for msg in await store.outbox.pending(limit=1_000_000):
        try:
            env = Envelope.from_bytes(msg.payload)
        except DecodeError:
            continue
        if env.correlation_id == correlation_id:
            nodes.append(Node(env, f"outbox, not yet sent to {msg.topic}"))
    return nodes


def _tree(nodes: list[Node]) -> list[Node]:
    by_id: dict[str, Node] = {}
    for node in sorted(nodes, key=lambda n: n.envelope.time):
        by_id.setdefault(node.envelope.id, node)
    roots: list[Node] = []
    for node in by_id.values():
        parent = by_id.get(node.envelope.causation_id or "")
        if parent is not None and parent is not node:
            parent.children.append(node)
        else:
            roots.append(node)
    return roots


def render(correlation_id: str, nodes: list[Node]) -> str:
    """The tree as indented text, oldest first at each level."""
    if not nodes:
        return f"no stored message has correlation id {correlation_id!r}"
    lines = [f"correlation {correlation_id}: {len(nodes)} stored message(s)"]

    def walk(node: Node, depth: int) -> None:
        env = node.envelope
        missing = ""
        if depth == 0 and env.causation_id and env.id != correlation_id:
            missing = f"  (caused by {env.causation_id}, not stored)"
        lines.append(
            f"{'  ' * (depth + 1)}{env.type} v{env.version}  {env.id}  from {env.source or '?'}"
            f"  {format_time(env.time)}{missing}"
        )
        lines.append(f"{'  ' * (depth + 2)}{node.where}")
        for child in node.children:
            walk(child, depth + 1)

    for root in _tree(nodes):
        walk(root, 0)
    return "\n".join(lines)


def command(args: argparse.Namespace) -> int:
    """Print the trace of one correlation id; exit 1 when nothing is stored for it."""
    configure_logging(args.log_level)
    target = resolve_target(args)

    async def run() -> list[Node]:
        await target.store.open()
        try:
            return await collect(target.store, args.correlation_id)
        finally:
            await target.store.close()

    nodes = asyncio.run(run())
    if not nodes:
        raise CliError(f"no stored message has correlation id {args.correlation_id!r}", 1)
    if args.json:
        print(
            orjson.dumps(
                {
                    "correlation_id": args.correlation_id,
                    "messages": [
                        {"where": n.where, "envelope": n.envelope.to_dict()} for n in nodes
                    ],
                },
                option=orjson.OPT_UTC_Z,
            ).decode()
        )
    else:
        print(render(args.correlation_id, nodes))
    return 0
