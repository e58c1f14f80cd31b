"""``eventflow sagas list|show|retry|skip|abort|diagram``: the sagas kept in a store.

``list`` and ``show`` read the store only (the saga index and the saga's stream), so they
need no code. ``retry``, ``skip`` and ``abort`` run the saga's state machine, which calls
the saga's own methods to build the commands it sends, so they need the saga's class:
``--saga MODULE:CLASS``, or ``--app MODULE:APP`` to take it from the app's ``sagas=`` (the
class whose ``name=`` is the saga's name in the index). Each is one store transaction: the
transition naming the person (``--by``), the index and timers, and the commands in the
store's outbox; a running app of that store sends them with its outbox relay (within
milliseconds: the commit wakes it), so nothing here needs the broker. ``diagram
MODULE:SAGA`` prints a Mermaid ``stateDiagram-v2`` of the saga's definition.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from ..events import default_registry
from ..sagas.control import STATUSES, Control, Wait
from ..sagas.definition import Saga, Step
from ..sagas.machine import Outcome
from ..sagas.persistence import IndexRow
from ..sagas.progress import refusal
from ..sagas.runtime import Sagas
from ._common import (
    EXIT_USAGE,
    CliError,
    Target,
    add_log_level,
    add_target_options,
    check_limit,
    configure_logging,
    format_time,
    load_object,
    resolve_target,
    table,
)

__all__ = ["CLI_SOURCE", "add_parser", "command", "diagram", "load_saga", "row_as_dict"]

CLI_SOURCE = "eventflow-cli"
"""The ``source`` of commands a retry issues when no ``--app`` is given."""

_DETAIL_WIDTH = 60

_OUTBOX_NOTE = (
    "The commands it issues are written to the store's outbox in the same transaction; a "
    "running app on this store sends them with its outbox relay (nothing is sent if no app "
    "runs)."
)
_CLASS_NOTE = (
    "It runs the saga's own methods, so it needs its class: --saga MODULE:CLASS, or --app "
    "MODULE:APP whose sagas= include it."
)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``sagas`` and its actions."""
    parser = subparsers.add_parser(
        "sagas",
        help="list sagas, show one's history, retry/skip/abort one, draw a definition",
        description=(
            "Inspect the sagas kept in a store and act on them as a person would. retry, "
            "skip and abort write the commands they issue to the store's outbox: a running "
            "app on that store sends them with its outbox relay."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = actions.add_parser("list", help="sagas in the index, most recently updated first")
    p.add_argument("--status", choices=STATUSES, help="only sagas with this status")
    p.add_argument("--name", help="only sagas of this name (the class's name=)")
    p.add_argument("--limit", type=int, default=100, help="at most this many (default: 100)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")

    p = actions.add_parser("show", help="one saga: status, state and its history with times")
    p.add_argument("id", metavar="ID", help="the saga's id, saga-<name>-<key>")
    p.add_argument("--json", action="store_true", help="print it as a JSON object")

    helps = {
        "retry": (
            "issue a failed saga's failed step or compensation again, under a new attempt "
            "(a new command id)"
        ),
        "skip": (
            "record that a person handled a failed saga's failed step or compensation by "
            "hand, and go on past it"
        ),
        "abort": (
            "stop a running saga (before its pivot) and compensate what it has done, newest first"
        ),
    }
    for name, text in helps.items():
        p = actions.add_parser(
            name,
            help=text,
            description=f"{text[0].upper()}{text[1:]}. {_CLASS_NOTE} {_OUTBOX_NOTE}",
        )
        p.add_argument("id", metavar="ID", help="the saga's id, saga-<name>-<key>")
        p.add_argument(
            "--by", required=True, metavar="NAME", help="who acts (recorded in the history)"
        )
        p.add_argument(
            "--saga",
            metavar="MODULE:CLASS",
            help="the saga's class (default: the one of --app's sagas= with the saga's name)",
        )
        if name == "abort":
            p.add_argument(
                "--reason",
                metavar="TEXT",
                help="why (recorded as the saga's reason; default: 'aborted by NAME')",
            )

    for sub in actions.choices.values():
        add_target_options(sub)
        add_log_level(sub, "WARNING")

    p = actions.add_parser(
        "diagram",
        help="print a Mermaid state diagram of a saga class",
        description=(
            "Print a Mermaid stateDiagram-v2 of a saga's definition: its steps in order with "
            "their reply, reject and timeout edges, the compensations newest first, the "
            "pivot, and the end states. Paste it into a ```mermaid block."
        ),
    )
    p.add_argument("spec", metavar="MODULE:SAGA", help="the saga class, e.g. shop.sagas:OrderSaga")
    p.add_argument(
        "--app-dir", default=".", metavar="DIR", help="where to import MODULE from (default: .)"
    )
    add_log_level(p, "WARNING")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run one ``sagas`` action; return the exit code."""
    configure_logging(args.log_level)
    if args.action == "diagram":
        print(diagram(load_saga(args.spec, args.app_dir)))
        return 0
    if args.action in ("retry", "skip", "abort") and not args.by.strip():
        raise CliError(f"sagas {args.action}: --by needs a name (who acts)", EXIT_USAGE)
    if args.action == "list":
        check_limit("sagas list", args.limit, "the default is 100")
    target = resolve_target(args)
    saga_cls = load_saga(args.saga, args.app_dir) if getattr(args, "saga", None) else None
    return asyncio.run(_run(args, target, saga_cls))


def load_saga(spec: str, app_dir: str | None = ".") -> type[Saga]:
    """Import ``module:Class`` and return the Saga class it names (``CliError`` exit 2)."""
    obj = load_object(spec, app_dir, "SAGA", _is_saga_class)
    if not _is_saga_class(obj):
        raise CliError(
            f"{spec!r} is {obj!r}, not a Saga class declared with name=, start=, key=",
            EXIT_USAGE,
        )
    saga_cls: type[Saga] = obj
    return saga_cls


def _is_saga_class(obj: object) -> bool:
    return isinstance(obj, type) and issubclass(obj, Saga) and "definition" in vars(obj)


async def _run(args: argparse.Namespace, target: Target, saga_cls: type[Saga] | None) -> int:
    sagas = target.app.sagas if target.app is not None else None
    source = target.app.name if target.app is not None else CLI_SOURCE
    await target.store.open()
    try:
        if sagas is None:
            sagas = Sagas(target.store, default_registry, source)
        if args.action == "list":
            return await _list(args, target, sagas)
        if args.action == "show":
            return await _show(args, sagas, target.description)
        return await _act(args, target, sagas, saga_cls)
    finally:
        await target.store.close()


# -- list and show -------------------------------------------------------------------------


async def _list(args: argparse.Namespace, target: Target, sagas: Sagas) -> int:
    rows = await sagas.list(status=args.status, name=args.name, limit=args.limit)
    if args.json:
        for row in rows:
            print(orjson.dumps(row_as_dict(row)).decode())
        return 0
    if not rows:
        which = " ".join(
            f"{k} {v!r}" for k, v in (("status", args.status), ("name", args.name)) if v
        )
        print(f"no sagas{' with ' + which if which else ''} in {target.description}")
        return 0
    cells = [
        [
            r.id,
            r.name,
            r.key,
            r.status,
            format_time(r.started),
            format_time(r.updated),
        ]
        for r in rows
    ]
    print(table(["ID", "NAME", "KEY", "STATUS", "STARTED", "UPDATED"], cells))
    return 0


def row_as_dict(row: IndexRow) -> dict[str, Any]:
    """A JSON-ready view of an index row (times in ISO 8601, UTC)."""
    return {
        "id": row.id,
        "name": row.name,
        "key": row.key,
        "status": row.status,
        "started": row.started.isoformat(),
        "updated": row.updated.isoformat(),
    }


async def _show(args: argparse.Namespace, sagas: Sagas, where: str) -> int:
    history = await sagas.persistence.history(args.id)
    if not history:
        raise CliError(_unknown(args.id, where))
    row = await sagas.find(args.id)
    last = next((d["saga"] for d in reversed(history) if "saga" in d), None)
    if last is None:
        raise CliError(f"{args.id!r} is not a saga's stream: none of its events has saga state")
    control = Control.from_dict(last["control"])
    transitions = [{k: v for k, v in d.items() if k != "saga"} for d in history]
    started = _utc(control.origin_ms / 1000)
    data: dict[str, Any] = {
        "id": args.id,
        "name": last["name"],
        "key": last["key"],
        "status": control.status,
        "reason": control.reason,
        "started": started.isoformat(),
        "updated": row.updated.isoformat() if row is not None else None,
        "correlation_id": control.correlation_id,
        "waiting": _waiting_dict(control),
        "timers": {
            name: {"due": _utc(t.due).isoformat(), "token": t.token}
            for name, t in control.timers.items()
        },
        "kept": [k.id for k in control.kept],
        "state": last["state"],
        "history": transitions,
    }
    if args.json:
        print(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return 0
    fields = [
        ("id", args.id),
        ("name", data["name"]),
        ("key", data["key"]),
        ("status", control.status),
        ("reason", control.reason or "-"),
        ("started", _at(started)),
        ("updated", _at(row.updated) if row is not None else "-"),
        ("correlation", control.correlation_id or "-"),
        ("waiting", _waiting(control)),
        ("timers", ", ".join(f"{n} due {_at(_utc(t.due))}" for n, t in control.timers.items())),
        ("state", orjson.dumps(last["state"]).decode()),
    ]
    if control.kept:
        fields.append(("kept", f"{len(control.kept)} inputs before its start"))
    for name, value in fields:
        print(f"{name + ':':<13}{value or '-'}")
    print(f"history ({len(transitions)} transitions, oldest first):")
    cells = [
        [
            _at(datetime.fromisoformat(t["at"])),
            t["kind"],
            t.get("step") or "-",
            _cut(t.get("detail") or ""),
            t.get("by") or "-",
            t.get("message_id") or "-",
        ]
        for t in transitions
    ]
    print(table(["AT", "KIND", "STEP", "DETAIL", "BY", "MESSAGE ID"], cells))
    return 0


def _waiting(control: Control) -> str:
    w = control.waiting
    if w is None:
        return "-"
    if w.wait is Wait.BACKOFF:
        return f"the backoff before {w.step} is sent again"
    what = "the reply of step" if w.wait is Wait.REPLY else "the reply of the compensation of"
    return f"{what} {w.step} (command {w.command_id})"


def _waiting_dict(control: Control) -> dict[str, Any] | None:
    w = control.waiting
    if w is None:
        return None
    return {"step": w.step, "kind": w.wait.value, "command_id": w.command_id}


# -- retry, skip, abort --------------------------------------------------------------------


async def _act(
    args: argparse.Namespace, target: Target, sagas: Sagas, saga_cls: type[Saga] | None
) -> int:
    row = await sagas.find(args.id)
    if row is None:
        raise CliError(_unknown(args.id, target.description))
    cls = _class_for(row, saga_cls, target)
    loaded = await sagas.persistence.load(cls.definition, row.key)
    if loaded is None:
        raise CliError(_unknown(args.id, target.description))
    why = refusal(loaded.control, args.action)
    if why is not None:
        raise CliError(f"saga {row.id} is {loaded.control.status}: {why}")
    outcome: Outcome
    if args.action == "retry":
        outcome = await sagas.retry(cls, row.key, by=args.by)
    elif args.action == "skip":
        outcome = await sagas.skip(cls, row.key, by=args.by)
    else:
        reason = args.reason or f"aborted by {args.by}"
        outcome = await sagas.abort(cls, row.key, by=args.by, reason=reason)
    for t in outcome.transitions:
        by = f"  by {t.by}" if t.by else ""
        print(f"{t.kind:<18}{t.step or '-':<14}{t.detail}{by}")
    status = outcome.status or "?"
    if not outcome.changed:
        # Another input changed the saga between the check above and the action.
        raise CliError(f"saga {row.id} changed meanwhile and is {status}: nothing done")
    sent = len(outcome.commands) + len(outcome.messages)
    note = (
        f"; {sent} command{'s' if sent != 1 else ''} in the outbox, sent by a running app"
        if sent
        else ""
    )
    print(f"saga {row.id} is {status}{note}")
    return 0


def _class_for(row: IndexRow, saga_cls: type[Saga] | None, target: Target) -> type[Saga]:
    if saga_cls is not None:
        if saga_cls.definition.name != row.name:
            raise CliError(
                f"saga {row.id} is a {row.name!r} saga, but {saga_cls.__name__} is declared "
                f"with name={saga_cls.definition.name!r}; pass the class of {row.name!r}",
                EXIT_USAGE,
            )
        return saga_cls
    if target.app is not None:
        found = target.app.sagas.saga_class(row.name)
        if found is not None:
            return found
        names = ", ".join(repr(c.definition.name) for c in target.app.sagas.classes) or "none"
        raise CliError(
            f"app {target.app.name!r} does not run the saga {row.name!r} (its sagas: "
            f"{names}); pass --saga MODULE:CLASS",
            EXIT_USAGE,
        )
    raise CliError(
        f"this needs the class of the saga {row.name!r} (its methods build the commands): "
        "pass --saga MODULE:CLASS, or --app MODULE:APP with that saga in its sagas=",
        EXIT_USAGE,
    )


def _unknown(saga_id: str, where: str) -> str:
    return (
        f"no saga {saga_id!r} in {where}: ids look like saga-<name>-<key>; see "
        "`eventflow sagas list` (with the same --store or --app)"
    )


# -- diagram ---------------------------------------------------------------------------------


def diagram(cls: type[Saga]) -> str:
    """A Mermaid ``stateDiagram-v2`` of the saga's definition.

    Steps in definition order (the pivot marked), each with its reply edge to the next
    step, its reject edge (to the compensations of the steps before it) and its timeout
    and abort edge (to the compensations from itself down: its command may have taken
    effect); steps after the pivot loop on themselves (retries) and end ``failed`` out of
    attempts. Compensations chain newest first; one with a reply ends ``failed`` without
    it in time. The end states are ``completed``, ``compensated`` and ``failed``.
    """
    d = cls.definition
    steps = d.steps
    pivot = next((i for i, s in enumerate(steps) if s.pivot), None)
    edges: dict[tuple[str, str], list[str]] = {}

    def edge(src: str, dst: str, label: str) -> None:
        labels = edges.setdefault((src, dst), [])
        if label not in labels:
            labels.append(label)

    def do(s: Step) -> str:
        return f"step_{s.name}"

    def undo(s: Step) -> str:
        return f"undo_{s.name}"

    def undo_from(i: int) -> str:
        """Where compensating steps[0..i] starts: the newest with a compensation."""
        for j in range(i, -1, -1):
            if steps[j].compensation is not None:
                return undo(steps[j])
        return "compensated"

    abort = "abort" + (f" ({_names(d.abort)})" if d.abort else "")
    edge("[*]", do(steps[0]) if steps else "completed", d.start.__name__)
    for i, s in enumerate(steps):
        nxt = do(steps[i + 1]) if i + 1 < len(steps) else "completed"
        edge(do(s), nxt, _names(s.reply) if s.reply else "done (no reply)")
        if not s.reply:
            continue  # done once sent: nothing waits here
        timeout = [f"timeout {s.timeout:g}s"] if s.timeout is not None else []
        if pivot is not None and i > pivot:
            failures = ([_names(s.reject)] if s.reject else []) + timeout
            if failures:
                edge(do(s), do(s), f"{' / '.join(failures)}, retry")
                edge(do(s), "failed", f"{s.retry} attempts spent")
            continue
        if s.reject:
            edge(do(s), undo_from(i - 1), _names(s.reject))
        for label in (*timeout, abort):
            edge(do(s), undo_from(i), label)
    for j, s in enumerate(steps):
        comp = s.compensation
        if comp is None:
            continue
        if comp.reply:
            edge(undo(s), undo_from(j - 1), _names(comp.reply))
            edge(undo(s), "failed", f"timeout {comp.timeout:g}s")
        else:
            edge(undo(s), undo_from(j - 1), "issued")

    used = {name for pair in edges for name in pair}
    lines = ["stateDiagram-v2"]
    for i, s in enumerate(steps):
        label = f"{s.name} (pivot)" if i == pivot else s.name
        lines.append(f'    state "{label}" as {do(s)}')
    for s in steps:
        if s.compensation is not None:
            lines.append(f'    state "{s.compensation.name} (undo {s.name})" as {undo(s)}')
    for (src, dst), labels in edges.items():
        lines.append(f"    {src} --> {dst} : {' / '.join(labels)}")
    for end in ("completed", "compensated"):
        if end in used:
            lines.append(f"    {end} --> [*]")
    if "failed" in used:
        lines.append("    note right of failed : a person decides, sagas retry or sagas skip")
    if pivot is not None:
        lines.append("    classDef pivot font-weight:bold,stroke-width:3px")
        lines.append(f"    class {do(steps[pivot])} pivot")
    return "\n".join(lines)


def _names(classes: Sequence[type]) -> str:
    return " / ".join(c.__name__ for c in classes)


# -- formatting ------------------------------------------------------------------------------


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def _at(when: datetime) -> str:
    """``2026-11-01 12:00:01.250Z``: UTC with milliseconds (timeouts are often seconds)."""
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _cut(text: str, width: int = _DETAIL_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
