"""Aggregate snapshots: the state at a version, stored so that a load replays fewer events.

A snapshot's ``state`` is ``{"format": 1, "schema": MARKER, "data": {...}}`` where ``data``
is the aggregate's ``model_dump(mode="json")`` without ``id`` and ``version`` (the
snapshot records the version; the stream id gives the id) and ``MARKER`` names the shape
of the state: the class's ``snapshot_version`` plus a hash of its JSON schema with titles
and descriptions left out. A snapshot whose marker differs from the class's current one
(a field was added, removed or retyped, or ``snapshot_version`` was bumped) is ignored and
the aggregate is rebuilt by a full replay; the next snapshot replaces it.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson
from pydantic import ValidationError

from ..ports import Snapshot
from .aggregate import Aggregate

__all__ = ["SNAPSHOT_FORMAT", "restore_snapshot", "schema_marker", "take_snapshot"]

SNAPSHOT_FORMAT = 1
_log = logging.getLogger("eventflow.sourcing")
_DOC_KEYS = frozenset({"title", "description", "examples"})
_NAME_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_EXCLUDE = {"id", "version"}
_markers: dict[type[Aggregate], str] = {}

A = TypeVar("A", bound=Aggregate)


def schema_marker(cls: type[Aggregate]) -> str:
    """A short string that changes when the shape of ``cls``'s state changes (or when its
    ``snapshot_version`` is bumped), and not when only docstrings or titles do."""
    marker = _markers.get(cls)
    if marker is None:
        try:
            shape: Any = _strip(cls.model_json_schema(mode="validation"))
        except Exception:  # a field type without a JSON schema: fall back to the annotations
            shape = {name: repr(f.annotation) for name, f in cls.model_fields.items()}
        digest = hashlib.sha256(orjson.dumps(shape, option=orjson.OPT_SORT_KEYS)).hexdigest()
        marker = _markers[cls] = f"v{cls.snapshot_version}:{digest[:16]}"
    return marker


def take_snapshot(stream_id: str, aggregate: Aggregate) -> Snapshot:
    """A snapshot of ``aggregate``'s current state (pending events included) at its version.

    Raises pydantic's serialisation error if a field cannot be written as JSON.
    """
    data = aggregate.model_dump(mode="json", exclude=_EXCLUDE)
    state = {"format": SNAPSHOT_FORMAT, "schema": schema_marker(type(aggregate)), "data": data}
    return Snapshot(stream_id, aggregate.version, state, datetime.now(UTC))


def restore_snapshot(cls: type[A], aggregate_id: str, snapshot: Snapshot) -> A | None:
    """The aggregate stored in ``snapshot``, or None if the snapshot is stale (another state
    shape or format) or does not validate; the caller then replays the whole stream."""
    state = snapshot.state
    marker = schema_marker(cls)
    if state.get("format") != SNAPSHOT_FORMAT or state.get("schema") != marker:
        _log.info(
            "ignoring the snapshot of %s at v%d: it was taken with state shape %r, the class "
            "now has %r; replaying the stream",
            snapshot.stream_id,
            snapshot.version,
            state.get("schema"),
            marker,
        )
        return None
    data = state.get("data")
    if not isinstance(data, dict) or snapshot.version < 1:
        return None
    try:
        return cls.model_validate({**data, "id": aggregate_id, "version": snapshot.version})
    except ValidationError as exc:
        _log.warning(
            "ignoring the snapshot of %s at v%d: it does not validate as %s (%s); replaying "
            "the stream",
            snapshot.stream_id,
            snapshot.version,
            cls.__qualname__,
            exc.errors()[:3],
        )
        return None


def _strip(node: Any, names: bool = False) -> Any:
    """The JSON schema without documentation keys (a mapping of names keeps every key)."""
    if isinstance(node, dict):
        if names:
            return {k: _strip(v) for k, v in node.items()}
        return {k: _strip(v, k in _NAME_MAPS) for k, v in node.items() if k not in _DOC_KEYS}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node
