"""The schema registry on disk: JSON Schemas per event version and an index, kept in git.

Layout, under a directory (``schemas/`` by default)::

    index.json                      every type: compatibility mode, versions, upcasters
    <type>/v<version>.json          JSON Schema 2020-12 of that version (pydantic, validation mode)

Files are written with sorted keys, 2-space indent and a trailing newline, so exporting the
same models twice gives byte-identical files and diffs show only real changes. The index
names upcasters by ``from_version`` only: no Python import path is ever written.

A published version is immutable: :func:`export_registry` refuses to rewrite a committed
schema whose contract differs from the code (``force=True`` overrides, for versions that
were never deployed). It never deletes anything; versions and types are retired explicitly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from ..errors import EventflowError
from ..events import Event, EventRegistry
from ..patterns import matches
from .contract import contract_diff

__all__ = [
    "DIALECT",
    "INDEX_FILE",
    "MODES",
    "ExportResult",
    "Index",
    "Mode",
    "SchemaRegistryError",
    "TypeEntry",
    "dumps",
    "event_schema",
    "export_registry",
    "load_index",
    "load_schema",
    "mode_of",
    "schema_path",
    "select_events",
]

Mode = Literal["backward", "forward", "full", "none"]
MODES: tuple[Mode, ...] = ("backward", "forward", "full", "none")
DIALECT = "https://json-schema.org/draft/2020-12/schema"
INDEX_FILE = "index.json"
INDEX_FORMAT = 1


class SchemaRegistryError(EventflowError):
    """The registry on disk is unreadable, or an export would rewrite a published version."""


def dumps(obj: Any) -> str:
    """The registry's normal form: sorted keys, 2-space indent, UTF-8, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def event_schema(cls: type[Event]) -> dict[str, Any]:
    """The JSON Schema (2020-12, validation mode) of one event class.

    Validation mode describes what a consumer's model accepts, which is what compatibility
    is about. ``x-eventflow-type`` and ``x-eventflow-version`` name the event, never its
    Python class path.
    """
    schema = cls.model_json_schema(mode="validation")
    schema["$schema"] = DIALECT
    schema["x-eventflow-type"] = cls.event_type
    schema["x-eventflow-version"] = cls.event_version
    # Round-trip through the normal form so in-memory schemas equal the loaded files.
    return cast(dict[str, Any], json.loads(dumps(schema)))


def mode_of(registry: EventRegistry, event_type: str) -> Mode:
    """The compatibility mode of a type: the one its latest version's class declares."""
    mode = registry.get(event_type).event_compatibility
    for known in MODES:
        if mode == known:
            return known
    return "backward"


def select_events(
    registry: EventRegistry,
    *,
    modules: Iterable[str] = (),
    include: Iterable[str] = (),
) -> EventRegistry:
    """A new registry holding only the chosen types (every version) and their upcasters.

    ``modules``: keep types with a class defined in one of these modules or a submodule.
    ``include``: keep types matching one of these NATS-style patterns (``shop.>``).
    Empty means no filter.
    """
    mods = tuple(modules)
    pats = tuple(include)
    chosen = EventRegistry()
    kept: set[str] = set()
    for event_type, versions in registry.types().items():
        classes = [registry.get(event_type, v) for v in versions]
        if mods and not any(
            c.__module__ == m or c.__module__.startswith(m + ".") for c in classes for m in mods
        ):
            continue
        if pats and not any(matches(p, event_type) for p in pats):
            continue
        kept.add(event_type)
        for cls in classes:
            chosen.register(cls)
    for (event_type, from_version), fn in registry.upcasters().items():
        if event_type in kept:
            chosen.add_upcaster(event_type, from_version, fn)
    return chosen


# -- the index -------------------------------------------------------------------------------


@dataclass
class TypeEntry:
    """One type in the index: its mode, versions, upcasters and retirement marks."""

    compatibility: Mode = "backward"
    versions: list[int] = field(default_factory=list)
    upcasters: list[int] = field(default_factory=list)
    """``from_version`` of each upcaster (``v -> v + 1``)."""
    retired: bool = False
    """The whole type is retired: no events of it are kept anywhere."""
    retired_versions: list[int] = field(default_factory=list)

    def to_json(self, event_type: str) -> dict[str, Any]:
        """The index form of this entry."""
        out: dict[str, Any] = {
            "compatibility": self.compatibility,
            "latest": max(self.versions) if self.versions else None,
            "versions": {
                str(v): {
                    "schema": f"{event_type}/v{v}.json",
                    **({"retired": True} if v in self.retired_versions else {}),
                }
                for v in sorted(self.versions)
            },
            "upcasters": [{"from_version": v, "to_version": v + 1} for v in sorted(self.upcasters)],
        }
        if self.retired:
            out["retired"] = True
        return out


@dataclass
class Index:
    """The parsed ``index.json``: type name -> :class:`TypeEntry`."""

    types: dict[str, TypeEntry] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The file form of the index."""
        return {
            "format": INDEX_FORMAT,
            "generator": "eventflow schema export",
            "types": {t: e.to_json(t) for t, e in sorted(self.types.items())},
        }


def load_index(directory: str | os.PathLike[str]) -> Index | None:
    """Read ``index.json`` under ``directory``; None when there is no registry yet."""
    path = Path(directory) / INDEX_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        index = Index()
        for event_type, entry in raw["types"].items():
            versions = sorted(int(v) for v in entry["versions"])
            index.types[event_type] = TypeEntry(
                compatibility=entry.get("compatibility", "backward"),
                versions=versions,
                upcasters=sorted(int(u["from_version"]) for u in entry.get("upcasters", [])),
                retired=bool(entry.get("retired", False)),
                retired_versions=[
                    int(v) for v, item in entry["versions"].items() if item.get("retired")
                ],
            )
        return index
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SchemaRegistryError(
            f"{path} is not a valid eventflow schema index ({type(exc).__name__}: {exc}); "
            "restore it from git or re-run `eventflow schema export`"
        ) from None


def schema_path(directory: str | os.PathLike[str], event_type: str, version: int) -> Path:
    """Where the schema of ``event_type`` v``version`` lives."""
    return Path(directory) / event_type / f"v{version}.json"


def load_schema(
    directory: str | os.PathLike[str], event_type: str, version: int
) -> dict[str, Any] | None:
    """Read a committed schema; None if the file is missing."""
    path = schema_path(directory, event_type, version)
    if not path.exists():
        return None
    try:
        return cast(dict[str, Any], json.loads(path.read_text(encoding="utf-8")))
    except ValueError as exc:
        raise SchemaRegistryError(f"{path} is not valid JSON: {exc}") from None


# -- export ----------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What an export wrote (paths relative to the registry directory)."""

    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Published schemas with no class in the code any more, kept as they were."""


def _parse_retire(items: Iterable[str]) -> dict[str, set[int] | None]:
    out: dict[str, set[int] | None] = {}
    for item in items:
        name, sep, version = item.partition(":")
        if not sep:
            out[name] = None
            continue
        try:
            number = int(version.lstrip("v"))
        except ValueError:
            raise SchemaRegistryError(
                f"--retire {item!r}: expected TYPE or TYPE:VERSION such as order.placed:1"
            ) from None
        current = out.setdefault(name, set())
        if current is not None:
            current.add(number)
    return out


def export_registry(
    registry: EventRegistry,
    directory: str | os.PathLike[str],
    *,
    force: bool = False,
    retire: Iterable[str] = (),
) -> ExportResult:
    """Write the schemas of every type in ``registry`` and the index under ``directory``.

    Raises :class:`SchemaRegistryError`, writing nothing, when a published version's
    contract differs from its class (unless ``force``). ``retire`` marks ``TYPE`` or
    ``TYPE:VERSION`` as retired in the index, so ``check`` accepts that they are gone.
    """
    root = Path(directory)
    index = load_index(root) or Index()
    retiring = _parse_retire(retire)
    files: dict[str, str] = {}
    conflicts: list[str] = []
    result = ExportResult()
    for event_type, versions in registry.types().items():
        entry = index.types.setdefault(event_type, TypeEntry())
        for version in versions:
            schema = event_schema(registry.get(event_type, version))
            rel = f"{event_type}/v{version}.json"
            old = load_schema(root, event_type, version) if version in entry.versions else None
            if old is not None and not force:
                changes = contract_diff(old, schema)
                if changes:
                    conflicts.append(f"{event_type} v{version}: {changes[0]}")
                    continue
            files[rel] = dumps(schema)
        entry.compatibility = mode_of(registry, event_type)
        entry.versions = sorted(set(entry.versions) | set(versions))
        entry.upcasters = sorted(v for (t, v) in registry.upcasters() if t == event_type and v >= 1)
    if conflicts:
        raise SchemaRegistryError(
            "published versions are immutable, but the code changed "
            + "; ".join(conflicts)
            + ". Revert the model, or add a new version with an upcaster; use --force only "
            "for a version that was never deployed"
        )
    for name, versions_to_retire in retiring.items():
        retired_entry = index.types.get(name)
        if retired_entry is None:
            raise SchemaRegistryError(f"--retire {name!r}: no such type in the registry")
        if versions_to_retire is None:
            retired_entry.retired = True
        else:
            unknown = versions_to_retire - set(retired_entry.versions)
            if unknown:
                raise SchemaRegistryError(
                    f"--retire {name}: no version {sorted(unknown)} in the registry"
                )
            retired_entry.retired_versions = sorted(
                set(retired_entry.retired_versions) | versions_to_retire
            )
    for event_type, entry in index.types.items():
        for version in entry.versions:
            rel = f"{event_type}/v{version}.json"
            if rel not in files and schema_path(root, event_type, version).exists():
                result.kept.append(rel)
    files[INDEX_FILE] = dumps(index.to_json())
    for rel, text in sorted(files.items()):
        path = root / rel
        if path.exists() and path.read_text(encoding="utf-8") == text:
            result.unchanged.append(rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        result.written.append(rel)
    return result
