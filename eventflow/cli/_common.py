"""Helpers shared by the ``eventflow`` subcommands: errors, app import, store resolution.

Import strings (``module:attr``) are resolved here and nowhere else in eventflow. Environment
variables are read here too, at the edge: ``EVENTFLOW_STORE`` and ``EVENTFLOW_BROKER``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..app import App
from ..brokers import open_broker
from ..errors import ConfigurationError, EventflowError
from ..ports import Broker, Store, declared
from ..runtime.deadletters import DeadLetters
from ..stores import store_for
from ..urls import redact_url

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "CliError",
    "Target",
    "add_log_level",
    "add_target_options",
    "check_limit",
    "configure_logging",
    "format_age",
    "format_time",
    "indent",
    "load_app",
    "load_object",
    "resolve_target",
    "table",
    "where_raised",
]

EXIT_FAILURE = 1
"""A command ran but failed (unknown dead-letter id, failed demo check, app crashed)."""
EXIT_USAGE = 2
"""The command line was wrong (bad MODULE:APP, bad URL, missing option), as argparse does."""

STORE_ENV = "EVENTFLOW_STORE"
BROKER_ENV = "EVENTFLOW_BROKER"
LOG_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class CliError(Exception):
    """A user error: printed as ``eventflow: error: <message>`` with exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


# -- logging ---------------------------------------------------------------------------------


def check_limit(command: str, limit: int | None, default: str) -> None:
    """Refuse a ``--limit`` below 1 (``CliError``, exit 2): ``--limit 0`` would answer that
    there is nothing, which is not true. ``default`` says what no ``--limit`` gives."""
    if limit is not None and limit < 1:
        raise CliError(f"{command}: --limit must be 1 or more, got {limit} ({default})", EXIT_USAGE)


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """Add ``--log-level`` (case-insensitive) to a subcommand's parser."""
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.upper,
        choices=_LEVELS,
        metavar="LEVEL",
        help=f"logging level on stderr: {', '.join(_LEVELS)} (default: {default})",
    )


def configure_logging(level: str) -> None:
    """Send log records to stderr at ``level`` (the eventflow logger and the root logger)."""
    logging.basicConfig(stream=sys.stderr, level=level, format=LOG_FORMAT)
    logging.getLogger().setLevel(level)
    logging.getLogger("eventflow").setLevel(level)


# -- MODULE:APP --------------------------------------------------------------------------------


def load_object(
    spec: str, app_dir: str | None, what: str, hint: Callable[[Any], bool] | None = None
) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted) and return the object it names.

    ``what`` names the kind of object in messages (``APP``, ``SAGA``); ``hint`` tells which
    attributes of the module to suggest when ``attr`` is missing. ``app_dir`` is put
    first on ``sys.path`` (like ``python -m`` does with the current directory). Raises
    ``CliError`` (exit code 2) saying what is wrong and how to fix it.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr or ":" in attr:
        raise CliError(
            f"expected MODULE:{what} such as 'shop.orders:{what.lower()}', got {spec!r}",
            EXIT_USAGE,
        )
    if app_dir is not None:
        path = os.path.abspath(app_dir)
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise CliError(
                f"cannot import module {module_name!r} ({exc}); run from the directory that "
                "contains it or pass --app-dir DIR",
                EXIT_USAGE,
            ) from None
        raise CliError(
            f"importing {module_name!r} failed: {exc} (a dependency of your module is missing)",
            EXIT_USAGE,
        ) from None
    except EventflowError as exc:
        raise CliError(
            f"importing {module_name!r} failed{where_raised(exc)}: {exc}", EXIT_USAGE
        ) from None
    except Exception as exc:
        raise CliError(
            f"importing {module_name!r} raised {type(exc).__name__}{where_raised(exc)}: {exc}",
            EXIT_USAGE,
        ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            found = sorted(k for k, v in vars(module).items() if hint is not None and hint(v))
            names = f"; {what.title()} objects in it: {', '.join(found)}" if found else ""
            raise CliError(
                f"module {module_name!r} has no attribute {attr!r}{names}", EXIT_USAGE
            ) from None
    return obj


def where_raised(exc: BaseException) -> str:
    """`` at shop/orders.py:12`` : where the user's code raised ``exc`` (or a SyntaxError
    points), so a person can go to the line; empty when no frame is known.

    The innermost frame outside eventflow and the import machinery is the user's line (an
    error raised by eventflow on the user's behalf, such as a bad ``App(...)`` argument,
    points at the call in the user's module).
    """
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" at {_short_path(exc.filename)}:{exc.lineno}"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(("<frozen", package))
    ]
    if not frames:
        return ""
    last = frames[-1]
    return f" at {_short_path(last.filename)}:{last.lineno}"


def _short_path(path: str) -> str:
    """``path`` relative to the current directory when it is under it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def load_app(spec: str, app_dir: str | None = ".") -> App:
    """Import ``module:attr`` (``attr`` may be dotted) and return the ``App`` it names.

    ``app_dir`` is put first on ``sys.path`` (like ``python -m`` does with the current
    directory), so ``eventflow run myservice:app`` finds ``./myservice.py``.
    Raises ``CliError`` (exit code 2) saying what is wrong and how to fix it.
    """
    obj = load_object(spec, app_dir, "APP", lambda v: isinstance(v, App))
    if not isinstance(obj, App):
        raise CliError(
            f"{spec!r} is a {type(obj).__name__}, not an eventflow App; point at the object "
            "created with App(...)",
            EXIT_USAGE,
        )
    return obj


# -- --store / --app / --broker ----------------------------------------------------------------


def add_target_options(parser: argparse.ArgumentParser, *, broker: bool = False) -> None:
    """Add ``--store``, ``--app``, ``--app-dir`` (and ``--broker``) to a subcommand."""
    group = parser.add_argument_group("where to look")
    group.add_argument(
        "--store",
        metavar="URL",
        help=f"store URL such as sqlite:///app.db (default: ${STORE_ENV})",
    )
    group.add_argument(
        "--app",
        metavar="MODULE:APP",
        help="take the store (and broker) of this app instead of --store",
    )
    group.add_argument(
        "--app-dir", default=".", metavar="DIR", help="where to import --app from (default: .)"
    )
    if broker:
        group.add_argument(
            "--broker",
            metavar="URL",
            help=f"broker URL for replay, such as nats://127.0.0.1:4222 (default: ${BROKER_ENV})",
        )


@dataclass(slots=True)
class Target:
    """What a store command works on: a store, a broker and the dead letters over both."""

    store: Store
    broker: Broker
    dead_letters: DeadLetters
    app: App | None
    description: str
    again: str = ""
    """The options that name this target again in a hint (``--store URL`` or ``--app X``)."""


def is_memory_broker(broker: Broker) -> bool:
    """True if ``broker`` is the in-process memory broker (unreachable from another process)."""
    from ..adapters.memory.broker import MemoryBroker

    return isinstance(broker, MemoryBroker)


def _check_sqlite_file(store: Store) -> None:
    from ..adapters.sqlite.store import SqliteStore

    if not isinstance(store, SqliteStore) or store.path == ":memory:":
        return
    if not os.path.exists(store.path):
        raise CliError(
            f"no SQLite database at {os.path.abspath(store.path)!r} (from {store.url!r}); "
            "sqlite:///x.db is relative to the current directory, sqlite:////abs/x.db is "
            "absolute",
            EXIT_USAGE,
        )


def resolve_target(args: argparse.Namespace) -> Target:
    """Build the store (and broker) named by ``--app``, ``--store`` or the environment.

    Nothing is opened here; raises ``CliError`` (exit code 2) for a missing or bad option.
    """
    app: App | None = None
    broker_url = getattr(args, "broker", None) or os.environ.get(BROKER_ENV)
    try:
        if args.app:
            app = load_app(args.app, args.app_dir)
            store, broker = app.store, app.broker
            if broker_url:
                broker = open_broker(broker_url)
            dead_letters = DeadLetters(store.dead_letters, broker, app.dead_letter_groups)
            description = f"app {app.name!r} (store {store.url})"
            again = f"--app {args.app}" + (
                f" --app-dir {args.app_dir}" if args.app_dir not in (None, ".") else ""
            )
        else:
            url = args.store or os.environ.get(STORE_ENV)
            if not url:
                raise CliError(
                    f"no store given: pass --store URL (e.g. sqlite:///app.db), --app "
                    f"MODULE:APP, or set {STORE_ENV}",
                    EXIT_USAGE,
                )
            store = store_for(url)
            broker = open_broker(broker_url or "memory://")
            dead_letters = DeadLetters(store.dead_letters, broker, None)
            description = f"store {redact_url(url)}"
            again = f"--store '{redact_url(url)}'" if args.store else ""
        durable = declared(store, Store, "durable")
    except ConfigurationError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if not durable:
        raise CliError(
            f"the store {store.url} lives inside the app's process, so the command line "
            "cannot see it; give the app a durable store (sqlite:///app.db or "
            "postgresql://...) and point --store at it, or inspect it from code (app.store, "
            "app.dead_letters)",
            EXIT_USAGE,
        )
    _check_sqlite_file(store)
    return Target(store, broker, dead_letters, app, description, again)


# -- output ------------------------------------------------------------------------------------


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Format rows as left-aligned columns under upper-case headers: drawn with rich when
    stdout is a terminal, plain columns (what scripts parse) otherwise."""
    from ._draw import terminal, terminal_table

    if terminal():
        return terminal_table(headers, rows)
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def format_time(when: datetime) -> str:
    """``2026-11-01 12:00:01Z``: UTC, second precision."""
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def format_age(when: datetime, now: datetime | None = None) -> str:
    """How long ago ``when`` was: ``0.4s``, ``12s``, ``5m``, ``3h``, ``2d``."""
    seconds = ((now or datetime.now(UTC)) - when).total_seconds()
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f}s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def indent(text: str, prefix: str = "  ") -> str:
    """Prefix every line of ``text``."""
    return "\n".join(f"{prefix}{line}" for line in text.splitlines())
