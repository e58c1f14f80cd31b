"""``eventflow run MODULE:APP [MODULE:APP ...]``: serve one or more apps until SIGINT/SIGTERM.

Several apps given together run in one process and one event loop, so apps on the
``memory://`` broker can talk to each other (the in-memory broker lives in the process).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from ..app import App
from ..errors import EventflowError
from ._common import EXIT_FAILURE, CliError, add_log_level, configure_logging, load_app

__all__ = ["add_parser", "command", "serve_all"]

_log = logging.getLogger("eventflow.cli")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the ``run`` subcommand."""
    parser = subparsers.add_parser(
        "run",
        help="run apps until SIGINT/SIGTERM",
        description=(
            "Import each MODULE:APP (an eventflow App object) and run it until SIGINT or "
            "SIGTERM, then shut down gracefully. Several apps run in one process, sharing "
            "the memory:// broker."
        ),
    )
    parser.add_argument(
        "apps", nargs="+", metavar="MODULE:APP", help="e.g. shop.orders:app (module path:attribute)"
    )
    parser.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="directory put first on sys.path before importing (default: .)",
    )
    parser.add_argument(
        "--port",
        type=int,
        metavar="PORT",
        help=(
            "serve /healthz, /readyz and /metrics on this port (the app's http_port; "
            "/metrics needs eventflow[prometheus]); one app per process"
        ),
    )
    parser.add_argument(
        "--host",
        default=None,
        metavar="HOST",
        help="the address --port listens on (default: the app's http_host, 0.0.0.0)",
    )
    add_log_level(parser, "INFO")
    parser.set_defaults(handler=command)


async def serve_all(apps: list[App], stop: asyncio.Event | None = None) -> None:
    """Serve every app in one event loop until ``stop`` is set or a signal arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    # This function owns SIGINT/SIGTERM for all the apps, so no app removes a handler
    # another still relies on while it drains.
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
    try:
        async with asyncio.TaskGroup() as tg:
            for app in apps:
                tg.create_task(
                    app.serve(stop, handle_signals=False), name=f"eventflow-run:{app.name}"
                )
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def _flatten(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _flatten(sub)]
    return [exc]


def command(args: argparse.Namespace) -> int:
    """Run the apps named on the command line; return the exit code."""
    configure_logging(args.log_level)
    apps = [load_app(spec, args.app_dir) for spec in args.apps]
    names = [app.name for app in apps]
    if len(set(names)) != len(names):
        raise CliError(f"two of the apps have the same name: {', '.join(names)}", 2)
    if args.port is not None:
        if len(apps) > 1:
            raise CliError(
                "--port serves one app: run each app in its own process with its own --port, "
                "or give each App(http_port=...) in code",
                2,
            )
        if not 0 <= args.port <= 65535:
            raise CliError(f"--port {args.port} is not a TCP port (0 to 65535)", 2)
        apps[0].http_port = args.port
    if args.host is not None:
        for app in apps:
            app.http_host = args.host
    try:
        if len(apps) == 1:
            apps[0].run()
        else:
            asyncio.run(serve_all(apps))
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        leaves = _flatten(exc)
        if all(isinstance(e, EventflowError) for e in leaves):
            raise CliError(
                "; ".join(f"{type(e).__name__}: {e}" for e in leaves), EXIT_FAILURE
            ) from None
        raise
    _log.info("stopped %s", ", ".join(names))
    return 0
