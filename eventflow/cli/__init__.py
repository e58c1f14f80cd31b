"""The ``eventflow`` command line.

::

    eventflow run MODULE:APP [MODULE:APP ...]     serve apps until SIGINT/SIGTERM
    eventflow demo [--orders N] [--broker URL]    the shop in one process: orders, checks
    eventflow dlq list|show|replay|purge          the dead-letter queue of a store
    eventflow status                              running app instances and DLQ sizes
    eventflow groups declare|list MODULE:APP      an app's consumer groups on its broker
    eventflow schema export|check|asyncapi        event schema registry in git, CI check
    eventflow projections list|status|rebuild     projections: lag, rebuild from the log
    eventflow store init|read|tail                the event store: schema, streams, live log
    eventflow trace CORRELATION_ID                the causal tree of one business transaction
    eventflow sagas list|show|retry|skip|abort    sagas: index, history, a person's actions
    eventflow sagas diagram MODULE:SAGA           a Mermaid state diagram of a saga class

Exit codes: 0 success, 1 the command failed (unknown id, failed check), 2 bad usage (bad
MODULE:APP, bad URL, missing option), 130 interrupted, 141 the reader of the output went
away (``| head``). User errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import EventflowError
from . import dlq, run, status
from . import groups as _groups
from . import projections as _projections
from . import sagas as _sagas
from . import schema as _schema
from . import store as _store
from . import trace as _trace
from ._common import EXIT_FAILURE, CliError

__all__ = ["build_parser", "main"]

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a reader that went away


def _add_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # The demo imports the shop (examples/shop); import it only when the demo runs.
    parser = subparsers.add_parser(
        "demo",
        help="run the shop (examples/shop) in one process and check its invariants",
        description=(
            "Run the shop's four services (orders with its saga, inventory, payments, "
            "shipping) in one process (memory:// broker, SQLite stores in a temporary "
            "directory, unless --broker/--store say otherwise), place orders through its "
            "HTTP API (some twice, some declined, some short of stock, some cancelled, some "
            "shipped late, plus one poison message), print a summary and one compensated "
            "order's causal tree, and verify the invariants. Exits 0 only if every check holds."
        ),
    )
    parser.add_argument(
        "--orders", type=int, default=300, metavar="N", help="orders to place (default: 300)"
    )
    parser.add_argument(
        "--broker",
        metavar="URL",
        help="the broker of every service (default: memory://; nats://..., kafka://...)",
    )
    parser.add_argument(
        "--store",
        metavar="URL",
        help=(
            "the shop's store; each service gets its own schema or file "
            "(default: SQLite files in a temporary directory; postgresql://...)"
        ),
    )
    parser.add_argument(
        "--seed", type=int, default=7, help="random seed of the orders (default: 7)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="give up waiting for the orders after this long (default: 60)",
    )
    from ._common import add_log_level

    add_log_level(parser, "ERROR")

    def command(args: argparse.Namespace) -> int:
        from . import demo

        return demo.command(args)

    parser.set_defaults(handler=command)


def build_parser() -> argparse.ArgumentParser:
    """Return the ``eventflow`` argument parser with every subcommand."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="eventflow",
        description="eventflow: run event-driven services and inspect their stores.",
    )
    parser.add_argument("--version", action="version", version=f"eventflow {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    run.add_parser(subparsers)
    _add_demo(subparsers)
    dlq.add_parser(subparsers)
    status.add_parser(subparsers)
    _groups.add_parser(subparsers)
    _projections.add_parser(subparsers)
    _schema.add_parser(subparsers)
    _store.add_parser(subparsers)
    _trace.add_parser(subparsers)
    _sagas.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``eventflow`` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except CliError as exc:
        print(f"eventflow: error: {exc}", file=sys.stderr)
        return exc.code
    except EventflowError as exc:
        print(f"eventflow: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("eventflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`eventflow ... | head`): stop quietly, as shell tools do.
        # stdout goes to /dev/null so that the interpreter's last flush does not fail too.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
