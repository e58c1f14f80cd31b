"""``eventflow schema check``: the models in code against the registry committed in git.

Rules (the ``rule`` field of each :class:`Problem`; errors fail the check):

- ``no-registry``: there is no ``index.json`` yet.
- ``unexported-version``: the code defines a version the registry does not have.
- ``published-schema-changed``: a committed version's contract differs from its class.
- ``type-removed`` / ``version-removed``: the registry has a type or version the code can no
  longer read (no class and no upcast path), unless retired in the index or allowed.
- compatibility rules between consecutive versions under the type's mode (see
  :mod:`eventflow.schema.compat`): an upcaster covers backward problems (it is the
  migration, proven below); forward problems cannot be covered (old readers run no upcaster).
- ``no-upcast-path``: an older version cannot be upcast to the latest.
- ``upcaster-failed`` / ``upcaster-invalid-output``: an upcaster chain raised, or its output
  fails the latest model, on the example payloads of an older version.
- ``example-invalid``: an ``examples`` entry does not validate as its own version.
- warnings: ``schema-stale`` (annotations or index metadata differ: re-export),
  ``upcaster-unused`` (an upcaster past the latest version), ``no-examples``.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..events import EventRegistry
from ..patterns import matches
from .compat import Direction, Incompatibility, compare_versions
from .contract import contract_diff
from .export import (
    INDEX_FILE,
    Index,
    TypeEntry,
    dumps,
    event_schema,
    load_index,
    load_schema,
    mode_of,
)
from .proof import prove_upcasters
from .report import CheckReport, Problem

__all__ = ["CheckReport", "Problem", "check_registry"]

_MAX_DIFFS = 10


def check_registry(
    registry: EventRegistry,
    directory: str | os.PathLike[str],
    *,
    allow_removal: bool = False,
    include: Iterable[str] = (),
) -> CheckReport:
    """Check the types of ``registry`` against the registry committed under ``directory``.

    ``include`` (NATS-style patterns) limits the committed types looked at, as
    :func:`~eventflow.schema.export.select_events` limits the code's.
    """
    report = CheckReport(str(directory))
    index = load_index(directory)
    patterns = tuple(include)
    if index is not None and patterns:
        index.types = {t: e for t, e in index.types.items() if any(matches(p, t) for p in patterns)}
    if index is None:
        report.problems.append(
            Problem(
                "error",
                "no-registry",
                "*",
                None,
                "",
                f"no schema registry at {Path(directory) / INDEX_FILE}",
                "run `eventflow schema export --app MODULE:APP` (or --module) and commit it",
            )
        )
        index = Index()
    code = registry.types()
    for event_type in sorted(set(code) | set(index.types)):
        entry = index.types.get(event_type)
        if event_type not in code:
            assert entry is not None
            _removed_type(report, event_type, entry, allow_removal)
            continue
        _TypeCheck(report, registry, Path(directory), event_type, entry, allow_removal).run()
    if index.types and not report.errors:
        stale = _stale_entries(registry, index, Path(directory) / INDEX_FILE)
        if stale:
            report.problems.append(
                Problem(
                    "warning",
                    "schema-stale",
                    stale[0],
                    None,
                    "",
                    f"{INDEX_FILE} does not match the code for {', '.join(stale)} (modes or "
                    "upcasters changed)",
                    "re-run `eventflow schema export` and commit",
                )
            )
    return report


def _stale_entries(registry: EventRegistry, index: Index, path: Path) -> list[str]:
    """The code's types whose index entry an export would change."""
    written = json.loads(path.read_text(encoding="utf-8")).get("types", {})
    stale = []
    for event_type, versions in registry.types().items():
        entry = copy.deepcopy(index.types.get(event_type, TypeEntry()))
        entry.compatibility = mode_of(registry, event_type)
        entry.versions = sorted(set(entry.versions) | set(versions))
        entry.upcasters = sorted(v for (t, v) in registry.upcasters() if t == event_type)
        if written.get(event_type) != entry.to_json(event_type):
            stale.append(event_type)
    return stale


def _removed_type(
    report: CheckReport, event_type: str, entry: TypeEntry, allow_removal: bool
) -> None:
    report.types[event_type] = {
        "compatibility": entry.compatibility,
        "latest": max(entry.versions, default=None),
        "versions": entry.versions,
        "upcasters": entry.upcasters,
        "in_code": False,
        "retired": entry.retired,
    }
    if entry.retired or allow_removal:
        return
    report.problems.append(
        Problem(
            "error",
            "type-removed",
            event_type,
            max(entry.versions, default=None),
            "",
            f"{event_type} is in the registry but no class defines it any more; stored or "
            "in-flight events of it would be dead-lettered as unknown",
            f"restore the Event class, or retire the type once no event of it is kept: "
            f"`eventflow schema export ... --retire {event_type}` (or check --allow-removal)",
        )
    )


class _TypeCheck:
    def __init__(
        self,
        report: CheckReport,
        registry: EventRegistry,
        directory: Path,
        event_type: str,
        entry: TypeEntry | None,
        allow_removal: bool,
    ) -> None:
        self.report = report
        self.registry = registry
        self.directory = directory
        self.type = event_type
        self.entry = entry or TypeEntry()
        self.allow_removal = allow_removal
        self.code_versions = registry.types()[event_type]
        self.latest = max(self.code_versions)
        self.mode = mode_of(registry, event_type)
        self.upcasters = sorted(v for (t, v) in registry.upcasters() if t == event_type)
        self.schemas: dict[int, dict[str, Any]] = {}

    def problem(
        self, rule: str, version: int | None, path: str, message: str, hint: str, **kw: Any
    ) -> None:
        severity = kw.pop("severity", "error")
        self.report.problems.append(
            Problem(severity, rule, self.type, version, path, message, hint, **kw)
        )

    def run(self) -> None:
        retired = set(self.entry.retired_versions)
        published = set(self.entry.versions)
        for version in self.code_versions:
            self._against_published(version, version in published)
        for version in sorted(published - set(self.code_versions)):
            committed = load_schema(self.directory, self.type, version)
            if version in retired:
                continue
            if committed is None:
                self.problem(
                    "version-removed",
                    version,
                    "",
                    f"the index lists v{version} but {self.type}/v{version}.json is missing",
                    "restore the file from git history",
                )
                continue
            self.schemas[version] = committed
            if version > self.latest:
                self._removed(version, f"the code's latest version is v{self.latest}")
        live = sorted(v for v in self.schemas if v not in retired)
        for older, newer in itertools.pairwise(live):
            self._compatibility(older, newer)
        for version in live:
            if version < self.latest:
                self._upcast_path(version)
        for from_version in self.upcasters:
            if from_version >= self.latest:
                self.problem(
                    "upcaster-unused",
                    from_version,
                    "",
                    f"an upcaster from v{from_version} exists but the latest version is "
                    f"v{self.latest}",
                    f"define v{from_version + 1} or delete the upcaster",
                    severity="warning",
                )
        self.report.types[self.type] = {
            "compatibility": self.mode,
            "latest": self.latest,
            "versions": live,
            "upcasters": self.upcasters,
            "in_code": True,
            "retired": False,
        }

    def _against_published(self, version: int, is_published: bool) -> None:
        schema = event_schema(self.registry.get(self.type, version))
        self.schemas[version] = schema
        if not is_published:
            self.problem(
                "unexported-version",
                version,
                "",
                f"v{version} is defined in the code but not in the registry",
                "run `eventflow schema export` and commit the new schema file and index",
            )
            return
        committed = load_schema(self.directory, self.type, version)
        if committed is None:
            self.problem(
                "unexported-version",
                version,
                "",
                f"the index lists v{version} but {self.type}/v{version}.json is missing",
                "run `eventflow schema export` and commit",
            )
            return
        changes = contract_diff(committed, schema)
        by_field: dict[str, list[str]] = {}
        for change in changes:
            path = change.split("'")[1] if change.startswith("field '") else ""
            by_field.setdefault(path, []).append(change)
        for path, group in list(by_field.items())[:_MAX_DIFFS]:
            self.problem(
                "published-schema-changed",
                version,
                path,
                f"v{version} is published but its model changed: {'; '.join(group)}",
                f"published versions are immutable: revert the change and add it as "
                f"v{self.latest + 1} with @upcaster({self.type!r}, "
                f"from_version={self.latest}); `export --force` only if v{version} never "
                "reached a broker or store",
            )
        if not changes and dumps(committed) != dumps(schema):
            self.problem(
                "schema-stale",
                version,
                "",
                f"v{version}'s documentation (titles, descriptions, examples) changed",
                "re-run `eventflow schema export` and commit (the contract is unchanged)",
                severity="warning",
            )

    def _removed(self, version: int, why: str) -> None:
        if self.allow_removal:
            return
        self.problem(
            "version-removed",
            version,
            "",
            f"v{version} is in the registry but the code can no longer read it ({why}); "
            f"stored v{version} events would be dead-lettered",
            f"restore the v{version} class, or retire it once no v{version} event is kept: "
            f"`eventflow schema export ... --retire {self.type}:{version}`",
        )

    def _compatibility(self, older: int, newer: int) -> None:
        found = compare_versions(self.schemas[older], self.schemas[newer], self.mode)
        covered = older in self.upcasters and newer == older + 1
        for direction, issue in found:
            if direction == "backward" and covered:
                continue  # the upcaster is the migration; it is proven on examples below
            self._incompatible(direction, issue, older, newer)

    def _incompatible(
        self, direction: Direction, issue: Incompatibility, older: int, newer: int
    ) -> None:
        rule = issue.rule(direction)
        writer, reader = (older, newer) if direction == "backward" else (newer, older)
        w_part, _, r_part = issue.detail.partition(" -> ")
        text = {
            "missing": (
                f"v{newer} adds required field {issue.path!r} without a default; v{older} "
                "events do not have it"
                if direction == "backward"
                else f"v{newer} removes field {issue.path!r}, which v{older} readers require"
            ),
            "optional": (
                f"{issue.path!r} is required in v{reader} but optional in v{writer}, so "
                f"v{writer} data may lack it"
            ),
            "extra": (
                f"v{writer} data carries {issue.path!r} but v{reader} forbids unknown fields"
            ),
            "enum": f"{issue.path!r}: v{writer} may hold {w_part} that v{reader} rejects"
            + (f" ({r_part})" if r_part else ""),
            "type": f"{issue.path!r} changed type: v{writer} has {w_part}, v{reader} "
            f"accepts {r_part}",
            "null": f"{issue.path!r}: v{writer} allows null, v{reader} does not",
            "constraint": f"{issue.path!r}: v{reader} constrains it more than v{writer}: "
            f"{issue.detail}",
        }[issue.kind]
        what = (
            "new readers read old events"
            if direction == "backward"
            else ("old readers read new events")
        )
        if direction == "backward":
            hint = (
                f"make the change compatible (a default, an optional field, a wider type), or "
                f"add @upcaster({self.type!r}, from_version={older}) that turns v{older} data "
                f"into valid v{newer} data"
            )
        else:
            hint = (
                f"v{older} consumers run no upcaster, so keep v{newer} readable by them (keep "
                "the field, its type and values), or relax the type's mode with "
                f"compatibility='backward' once no v{older} consumer runs"
            )
        self.problem(
            rule,
            newer,
            issue.path,
            f"not {direction} compatible with v{older} ({self.mode} mode: {what}): {text}",
            hint,
            against=older,
            direction=direction,
        )

    def _upcast_path(self, version: int) -> None:
        missing = [v for v in range(version, self.latest) if v not in self.upcasters]
        if missing and version not in self.code_versions:
            self._removed(version, f"it has no class and no upcaster from v{missing[0]}")
            return
        if missing:
            step = missing[0]
            if step != version and step in self.schemas:
                return  # reported once, for the version the gap starts at
            nxt = self.schemas.get(step + 1)
            easy = (
                nxt is not None
                and step in self.schemas
                and not compare_versions(self.schemas[step], nxt, "backward")
            )
            self.problem(
                "no-upcast-path",
                version,
                "",
                f"v{version} events cannot be read as v{self.latest}: no upcaster from "
                f"v{step} to v{step + 1}",
                f"add @upcaster({self.type!r}, from_version={step})"
                + (
                    f"; v{step} data already validates as v{step + 1}, so `return data` is enough"
                    if easy
                    else f" that turns v{step} data into v{step + 1} data"
                ),
            )
            return
        problems, count = prove_upcasters(
            self.registry, self.type, version, self.schemas[version], self.latest
        )
        self.report.problems += problems
        self.report.examples_run += count
