"""``eventflow schema export|check|asyncapi``: the event schema registry kept in git.

::

    eventflow schema export   --app MODULE:APP | --module MODULE [--dir schemas] [--force]
                              [--retire TYPE[:VERSION]]
    eventflow schema check    --app MODULE:APP | --module MODULE [--dir schemas] [--json]
                              [--allow-removal]
    eventflow schema asyncapi --app MODULE:APP [--output FILE|-] [--doc-version V]

``--module`` takes the Event types defined in that module and its submodules (repeatable);
``--app`` takes every type in the app's registry. ``--include PATTERN`` narrows either to
types matching a NATS-style pattern (``shop.>``). Exit codes: 0 passed, 1 the check failed
or the export was refused, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from ..errors import EventflowError
from ..events import EventRegistry, default_registry
from ..schema.asyncapi import build_asyncapi
from ..schema.check import check_registry
from ..schema.export import SchemaRegistryError, export_registry, select_events
from ._common import EXIT_FAILURE, EXIT_USAGE, CliError, load_app, where_raised

__all__ = ["add_parser", "command"]

DEFAULT_DIR = "schemas"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``schema`` and its actions."""
    parser = subparsers.add_parser(
        "schema",
        help="export, check or document the event schema registry",
        description=(
            "Keep event schemas in git (schemas/<type>/v<version>.json and index.json), "
            "check the code against them in CI, and write an AsyncAPI 3.0 document."
        ),
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export", help="write the schemas and index of the code's event types"
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="rewrite published versions whose model changed (only if never deployed)",
    )
    export.add_argument(
        "--retire",
        action="append",
        default=[],
        metavar="TYPE[:VERSION]",
        help="mark a removed type or version as retired in the index (repeatable)",
    )
    check = actions.add_parser(
        "check", help="fail if the code breaks the committed registry (for CI)"
    )
    check.add_argument("--json", action="store_true", help="print a JSON report")
    check.add_argument(
        "--allow-removal",
        action="store_true",
        help="accept types and versions that are in the registry but gone from the code",
    )
    asyncapi = actions.add_parser("asyncapi", help="write an AsyncAPI 3.0 document of an app")
    asyncapi.add_argument(
        "--output",
        "-o",
        default="asyncapi.json",
        metavar="FILE",
        help="where to write it, '-' for stdout (default: asyncapi.json)",
    )
    asyncapi.add_argument(
        "--doc-version", default="1.0.0", help="info.version of the document (default: 1.0.0)"
    )
    for name, sub in actions.choices.items():
        group = sub.add_argument_group("which event types")
        group.add_argument("--app", metavar="MODULE:APP", help="the types of this app's registry")
        if name != "asyncapi":
            group.add_argument(
                "--module",
                action="append",
                default=[],
                metavar="MODULE",
                help="the types defined in this module and its submodules (repeatable)",
            )
            sub.add_argument(
                "--dir",
                default=DEFAULT_DIR,
                metavar="DIR",
                help=f"the registry directory (default: {DEFAULT_DIR})",
            )
        group.add_argument(
            "--include",
            action="append",
            default=[],
            metavar="PATTERN",
            help="only types matching this pattern, such as 'shop.>' (repeatable)",
        )
        group.add_argument(
            "--app-dir", default=".", metavar="DIR", help="where to import from (default: .)"
        )
    parser.set_defaults(handler=command)


def _import_modules(names: list[str], app_dir: str) -> None:
    path = os.path.abspath(app_dir)
    if path not in sys.path:
        sys.path.insert(0, path)
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise CliError(
                f"cannot import module {name!r} ({exc}); run from the directory that contains "
                "it or pass --app-dir DIR",
                EXIT_USAGE,
            ) from None
        except Exception as exc:
            raise CliError(
                f"importing {name!r} raised {type(exc).__name__}{where_raised(exc)}: {exc}",
                EXIT_USAGE,
            ) from None


def _registry(args: argparse.Namespace) -> EventRegistry:
    modules: list[str] = getattr(args, "module", [])
    if bool(args.app) == bool(modules):
        raise CliError(
            f"schema {args.action}: pass --app MODULE:APP or --module MODULE (one of them)",
            EXIT_USAGE,
        )
    if args.app:
        app = load_app(args.app, args.app_dir)
        registry = select_events(app.registry, include=args.include)
    else:
        _import_modules(modules, args.app_dir)
        registry = select_events(default_registry, modules=modules, include=args.include)
    if not registry.types():
        raise CliError(
            f"no event types found in {args.app or ', '.join(modules)}"
            + (f" matching {args.include}" if args.include else "")
            + "; point at the module that defines the Event classes",
            EXIT_USAGE,
        )
    return registry


def command(args: argparse.Namespace) -> int:
    """Run one ``schema`` action; return the exit code."""
    if args.action == "asyncapi":
        return _asyncapi(args)
    registry = _registry(args)
    if args.action == "export":
        try:
            result = export_registry(registry, args.dir, force=args.force, retire=args.retire)
        except SchemaRegistryError as exc:
            raise CliError(str(exc), EXIT_FAILURE) from None
        except OSError as exc:
            raise CliError(
                f"cannot write the registry under {args.dir!r}: {exc}; pass --dir with a "
                "writable directory",
                EXIT_USAGE,
            ) from None
        for rel in result.written:
            print(f"wrote {os.path.join(args.dir, rel)}")
        print(
            f"schema export: {len(result.written)} written, {len(result.unchanged)} unchanged, "
            f"{len(result.kept)} kept without a class ({args.dir})"
        )
        return 0
    try:
        report = check_registry(
            registry, args.dir, allow_removal=args.allow_removal, include=args.include
        )
    except EventflowError as exc:
        raise CliError(str(exc), EXIT_FAILURE) from None
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=True))
    else:
        print(report.render(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else EXIT_FAILURE


def _asyncapi(args: argparse.Namespace) -> int:
    if not args.app:
        raise CliError("schema asyncapi: pass --app MODULE:APP", EXIT_USAGE)
    app = load_app(args.app, args.app_dir)
    registry = select_events(app.registry, include=args.include)
    doc = build_asyncapi(app, registry=registry, version=args.doc_version)
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            raise CliError(
                f"cannot write {args.output!r}: {exc.strerror or exc}; create the directory "
                "first or pass -o with a writable path (or -o - for stdout)",
                EXIT_USAGE,
            ) from None
        print(
            f"wrote {args.output}: {len(doc['channels'])} channels, "
            f"{len(doc['components']['messages'])} messages"
        )
    return 0
