"""``eventflow trace CORRELATION_ID``: the causal tree of one business transaction.

Every envelope carries the ``correlation_id`` of the transaction it belongs to and the
``causation_id`` of the message whose handling produced it. This command gathers what the
store keeps of one correlation — events appended to the event store, dead letters and
messages still waiting in the outbox — and prints them as a tree, each under its cause.
Messages that only ever travelled through the broker are not stored, so they appear only as
the (missing) causes of what is.

Saga transitions are events of the saga's stream (``saga-<name>-<key>``) with the
correlation id of the saga and, as ``causation_id``, the id of the message the saga handled.
Each shows as ``saga transition KIND STEP DETAIL``. The transitions one input made (a
message, a timer, a person's action) are grouped under that input; a command a saga sent
is known by the transition that sent it (its id is in the saga's saved state), so what the
command caused (a dead letter, the command still in the outbox, a stored event) and the
answer the saga took as its reply (the input it handled while it waited for that command)
nest under that transition, even though neither the command nor the reply is stored.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

import orjson

from ..envelope import Envelope
from ..errors import DecodeError
from ..ports import Store, declared
from ..sagas.control import Control
from ..sagas.persistence import TRANSITION_TYPE
from ._common import (
    CliError,
    add_log_level,
    add_target_options,
    configure_logging,
    format_time,
    resolve_target,
)
from ._draw import terminal, terminal_tree

__all__ = ["Node", "SagaMark", "add_parser", "collect", "mermaid", "render"]


@dataclass(slots=True)
class SagaMark:
    """What a saga transition node is: the saga, the transition and the command it sent."""

    saga_id: str
    version: int
    transition: dict[str, Any]
    control: dict[str, Any] | None  # the saga's control state, on the last of a batch
    command_id: str | None = None  # set for command-sent and compensation-sent


@dataclass(slots=True)
class Node:
    """One message of the trace and where it was found.

    ``envelope`` is None for a message that is not stored but known as the cause of saga
    transitions (a start event, a reply, a timer, a person's action): ``where`` says what
    it was. ``saga`` is set for a saga transition (an event of the saga's stream).
    """

    envelope: Envelope | None
    where: str
    children: list[Node] = field(default_factory=list)
    saga: SagaMark | None = None
    id: str = ""  # the placeholder's message id, if known
    cause_handled_by: tuple[str, ...] = ()
    """The groups whose dedup records say they handled this message's cause, when the
    cause itself only travelled through the broker (not stored)."""

    @property
    def time(self) -> float:
        """When it happened (a placeholder: when its first child did)."""
        if self.envelope is not None:
            return self.envelope.time.timestamp()
        return min((c.time for c in self.children), default=0.0)


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
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--mermaid", action="store_true", help="print a Mermaid flowchart of the tree")
    add_target_options(parser)
    add_log_level(parser, "WARNING")
    parser.set_defaults(handler=command)


async def collect(store: Store, correlation_id: str) -> list[Node]:
    """Every stored message of ``correlation_id`` (event log, dead letters, outbox)."""
    nodes: list[Node] = []
    for rec in await declared(store, Store, "correlated")(correlation_id):
        if rec.envelope.correlation_id == correlation_id:  # (an index is not a promise)
            where = f"store {rec.stream_id}@{rec.stream_version} (position {rec.position})"
            node = Node(rec.envelope, where)
            if rec.envelope.type == TRANSITION_TYPE:
                data = dict(rec.envelope.data)
                state = data.pop("saga", None)
                control = state.get("control") if isinstance(state, dict) else None
                node.saga = SagaMark(rec.stream_id, rec.stream_version, data, control)
            nodes.append(node)
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
    _saga_batches(nodes)  # names the commands on the transitions that sent them
    await _broker_hops(store, nodes)
    return nodes


_MAX_HOPS = 200  # causes looked up in the dedup records, at most


async def _broker_hops(store: Store, nodes: list[Node]) -> None:
    """For a message whose cause is not stored (it only travelled through the broker), the
    consumer groups whose dedup records say they handled that cause: the groups the running
    instances subscribe with and those with dead letters."""
    stored = {n.envelope.id for n in nodes if n.envelope is not None}
    missing = [
        n
        for n in nodes
        if n.envelope is not None
        and n.saga is None
        and n.envelope.causation_id
        and n.envelope.causation_id not in stored
    ][:_MAX_HOPS]
    if not missing:
        return
    groups = {
        sub.rpartition(":")[0]
        for beat in await store.heartbeats.list()
        for sub in beat.subscriptions
        if ":" in sub
    } | set(await store.dead_letters.count())
    dedup = store.dedup
    for node in missing:
        assert node.envelope is not None and node.envelope.causation_id is not None
        cause = node.envelope.causation_id
        node.cause_handled_by = tuple(sorted([g for g in groups if await dedup.seen(g, cause)]))


def _tree(nodes: list[Node]) -> list[Node]:
    by_id: dict[str, Node] = {}
    for node in sorted(nodes, key=lambda n: n.time):
        assert node.envelope is not None
        by_id.setdefault(node.envelope.id, node)
    # Messages a saga sent are known by the command-sent transition that issued them, and
    # causes that are not stored get a placeholder holding what they caused.
    commands: dict[str, Node] = {}
    placeholders: dict[str, Node] = {}
    parents: dict[int, Node] = {}
    roots: list[Node] = []
    for batch, answered in _saga_batches(list(by_id.values())):
        for node in batch:
            assert node.saga is not None
            if node.saga.command_id:
                commands[node.saga.command_id] = node
        first = batch[0]
        assert first.envelope is not None and first.saga is not None
        cause = first.envelope.causation_id
        if cause is not None and cause in by_id:
            continue  # under the stored message that caused it, as any other message
        key = cause or f"saga-input:{first.envelope.id}"
        holder = placeholders.get(key)
        if holder is None:
            holder = Node(None, _cause_label(first.saga, cause, answered), id=cause or "")
            placeholders[key] = holder
            parent = commands.get(answered or "")
            if parent is not None:
                parents[id(holder)] = parent
        for node in batch:
            parents[id(node)] = holder
    for node in by_id.values():
        assert node.envelope is not None
        parent = parents.get(id(node))
        if parent is None:
            if node.envelope.id in commands and commands[node.envelope.id] is not node:
                parent = commands[node.envelope.id]  # the command itself (outbox)
            else:
                cause = node.envelope.causation_id or ""
                parent = by_id.get(cause) or commands.get(cause) or placeholders.get(cause)
        if parent is not None and parent is not node:
            parent.children.append(node)
        else:
            roots.append(node)
    for holder in placeholders.values():
        parent = parents.get(id(holder))
        (parent.children if parent is not None else roots).append(holder)
    _sort(roots)
    return roots


def _sort(nodes: list[Node]) -> None:
    def order(n: Node) -> tuple[float, str, int]:
        mark = n.saga
        return (n.time, mark.saga_id, mark.version) if mark else (n.time, "", 0)

    nodes.sort(key=order)
    for n in nodes:
        _sort(n.children)


def _saga_batches(nodes: list[Node]) -> list[tuple[list[Node], str | None]]:
    """The transitions of each saga cut into the batches one input made (each ends with the
    one carrying the saga's state), with the command the input answered (the one the saga
    waited for before it). Command ids go onto the transitions that sent them."""
    streams: dict[str, list[Node]] = {}
    for node in nodes:
        if node.saga is not None:
            streams.setdefault(node.saga.saga_id, []).append(node)
    out: list[tuple[list[Node], str | None]] = []
    for stream in streams.values():
        stream.sort(key=lambda n: n.saga.version if n.saga else 0)
        issued = 0
        waiting: str | None = None
        batch: list[Node] = []
        for node in stream:
            batch.append(node)
            mark = node.saga
            assert mark is not None
            if mark.control is None:
                continue
            sent = [n for n in batch if n.saga and n.saga.transition["kind"] in _SENT]
            control = Control.from_dict(mark.control)
            new = [i.id for i in control.issued][issued:]
            for n, command_id in zip(sent, new, strict=False):
                assert n.saga is not None
                n.saga.command_id = command_id
            issued += len(new)
            out.append((batch, waiting))
            waiting = control.waiting.command_id if control.waiting is not None else None
            batch = []
        if batch:  # the rest of a batch cut off by the correlation (should not happen)
            out.append((batch, waiting))
    return out


_SENT = ("command-sent", "compensation-sent")
_PERSON = {"retried": "retry", "skipped": "skip", "aborted": "abort"}


def _cause_label(mark: SagaMark, cause: str | None, answered: str | None) -> str:
    """What the unstored input of a batch of transitions was."""
    t = mark.transition
    kind, detail, by = t["kind"], t.get("detail") or "", t.get("by")
    if cause is None:
        if by:
            return f"{by} ran `eventflow sagas {_PERSON.get(kind, kind)}` (no message)"
        if kind == "timed-out":
            return f"the deadline of {t.get('step')} passed (a timer, no message)"
        return "a timer fired (no message)"
    what = ""
    if kind in ("replied", "rejected") or (kind == "compensated" and t.get("step")):
        what = f": {detail}" + (f", the answer to command {answered}" if answered else "")
    elif kind == "started":
        what = f": the message that started {mark.saga_id}"
    elif detail:
        what = f": {detail}"
    return f"{cause}  not stored{what}"


def render(correlation_id: str, nodes: list[Node]) -> str:
    """The tree as indented text, oldest first at each level."""
    if not nodes:
        return f"no stored message has correlation id {correlation_id!r}"
    lines = [_heading(correlation_id, nodes)]

    def walk(node: Node, depth: int) -> None:
        pad = "  " * (depth + 1)
        env = node.envelope
        if env is None:
            lines.append(f"{pad}{node.where}")
        elif node.saga is not None:
            lines.append(f"{pad}{_transition_line(node.saga, env)}")
        if env is None or node.saga is not None:
            for child in node.children:
                walk(child, depth + 1)
            return
        missing = ""
        if depth == 0 and env.causation_id and env.id != correlation_id:
            missing = f"  (caused by {env.causation_id}, not stored{_hop(node)})"
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


def _hop(node: Node) -> str:
    groups = node.cause_handled_by
    return f"; handled by group {', '.join(groups)} on the broker" if groups else ""


def _transition_line(mark: SagaMark, env: Envelope) -> str:
    t = mark.transition
    parts = ["saga transition", f"{t['kind']}{' ' + t['step'] if t.get('step') else ''}"]
    if t.get("detail"):
        parts.append(str(t["detail"]))
    if t.get("by"):
        parts.append(f"by {t['by']}")
    if mark.command_id:
        parts.append(f"command {mark.command_id}")
    stamp = env.time.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    parts.append(f"{mark.saga_id}@{mark.version}  {stamp}")
    return "  ".join(parts)


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
                    "messages": [_as_json(n) for n in nodes],
                },
                option=orjson.OPT_UTC_Z,
            ).decode()
        )
    elif args.mermaid:
        print(mermaid(nodes))
    elif terminal():
        print(
            terminal_tree(
                _heading(args.correlation_id, nodes), _branches(_tree(nodes), args.correlation_id)
            )
        )
    else:
        print(render(args.correlation_id, nodes))
    return 0


def _heading(correlation_id: str, nodes: list[Node]) -> str:
    sagas = sum(1 for n in nodes if n.saga is not None)
    return f"correlation {correlation_id}: {len(nodes)} stored message(s)" + (
        f", {sagas} of them saga transitions" if sagas else ""
    )


def _branches(
    nodes: list[Node], correlation_id: str, top: bool = True
) -> list[tuple[str, list[Any]]]:
    """The tree as ``(text, children)`` pairs for the terminal: the same lines as
    :func:`render`, a message's second line (where it was found) under its first."""
    out: list[tuple[str, list[Any]]] = []
    for node in nodes:
        env = node.envelope
        if env is None:
            text = node.where
        elif node.saga is not None:
            text = _transition_line(node.saga, env)
        else:
            missing = ""
            if top and env.causation_id and env.id != correlation_id:
                missing = f"  (caused by {env.causation_id}, not stored{_hop(node)})"
            text = (
                f"{env.type} v{env.version}  {env.id}  from {env.source or '?'}  "
                f"{format_time(env.time)}{missing}\n{node.where}"
            )
        out.append((text, _branches(node.children, correlation_id, top=False)))
    return out


def mermaid(nodes: list[Node]) -> str:
    """The tree as a Mermaid ``flowchart TD``: a box per message (type, id, where it was
    found), a rounded one per saga transition, a dashed one per cause that is not stored,
    and an arrow from each cause to what it caused."""
    lines = ["flowchart TD"]
    count = 0

    def box(node: Node) -> str:
        nonlocal count
        count += 1
        name = f"m{count}"
        env = node.envelope
        if env is None:
            lines.append(f'    {name}["{_label(node.where)}"]:::missing')
        elif node.saga is not None:
            t = node.saga.transition
            step = f" {t['step']}" if t.get("step") else ""
            text = f"{t['kind']}{step}<br/>{node.saga.saga_id}@{node.saga.version}"
            lines.append(f'    {name}("{_label(text)}")')
        else:
            text = f"{env.type} v{env.version}<br/>{env.id}<br/>{node.where}"
            lines.append(f'    {name}["{_label(text)}"]')
        for child in node.children:
            lines.append(f"    {name} --> {box(child)}")
        return name

    for root in _tree(nodes):
        box(root)
    lines.append("    classDef missing stroke-dasharray: 4 4")
    return "\n".join(lines)


def _label(text: str) -> str:
    return text.replace('"', "#quot;")


def _as_json(node: Node) -> dict[str, Any]:
    assert node.envelope is not None
    out: dict[str, Any] = {"where": node.where, "envelope": node.envelope.to_dict()}
    if node.cause_handled_by:
        out["cause_handled_by"] = list(node.cause_handled_by)
    if node.saga is not None:
        out["saga_transition"] = {
            "saga_id": node.saga.saga_id,
            "version": node.saga.version,
            **node.saga.transition,
            "command_id": node.saga.command_id,
        }
    return out
