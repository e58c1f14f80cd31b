"""Lossless mapping between envelopes and CloudEvents 1.0 structured JSON.

=================  =====================================================
Envelope field     CloudEvents attribute
=================  =====================================================
id                 ``id``
type               ``type``
source             ``source`` (``"eventflow"`` stands in for an empty source)
time               ``time`` (RFC 3339, UTC)
data               ``data`` with ``datacontenttype: application/json``
version            extension ``eventversion``
correlation_id     extension ``correlationid``
causation_id       extension ``causationid`` (absent when None)
key                extension ``partitionkey`` (the CloudEvents partitioning extension)
headers            each header whose name is a valid extension name (lowercase letters and
                   digits, at most 20) and not taken becomes an extension of that name
                   (``traceparent`` included, as the distributed-tracing extension wants);
                   the others travel together, JSON-encoded, in ``eventflowheaders``
=================  =====================================================

``from_cloudevent`` reverses this; unknown extensions of foreign events become headers.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import orjson

from .envelope import Envelope
from .errors import MalformedMessageError

__all__ = ["from_cloudevent", "to_cloudevent"]

SPEC_VERSION = "1.0"
_EMPTY_SOURCE = "eventflow"
_HEADERS_EXT = "eventflowheaders"
_EMPTY_SOURCE_EXT = "eventflowemptysource"
_NAME = re.compile(r"^[a-z0-9]{1,20}$")
_CORE = frozenset(
    {
        "specversion",
        "id",
        "source",
        "type",
        "time",
        "datacontenttype",
        "dataschema",
        "subject",
        "data",
        "data_base64",
        "eventversion",
        "correlationid",
        "causationid",
        "partitionkey",
        _HEADERS_EXT,
        _EMPTY_SOURCE_EXT,
    }
)


def _time(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def to_cloudevent(env: Envelope) -> dict[str, Any]:
    """Return the CloudEvents 1.0 structured-JSON form of ``env`` (a JSON-ready dict)."""
    ce: dict[str, Any] = {
        "specversion": SPEC_VERSION,
        "id": env.id,
        "source": env.source or _EMPTY_SOURCE,
        "type": env.type,
        "time": _time(env.time),
        "datacontenttype": "application/json",
        "eventversion": env.version,
        "correlationid": env.correlation_id,
    }
    if not env.source:
        ce[_EMPTY_SOURCE_EXT] = True
    if env.causation_id is not None:
        ce["causationid"] = env.causation_id
    if env.key is not None:
        ce["partitionkey"] = env.key
    leftovers: dict[str, str] = {}
    for name, value in env.headers.items():
        if _NAME.match(name) and name not in _CORE:
            ce[name] = value
        else:
            leftovers[name] = value
    if leftovers:
        ce[_HEADERS_EXT] = orjson.dumps(leftovers).decode()
    ce["data"] = env.data
    return ce


def from_cloudevent(ce: dict[str, Any]) -> Envelope:
    """Build an envelope from a CloudEvents 1.0 structured-JSON dict.

    Raises ``MalformedMessageError`` when a required attribute is missing or the data is not
    a JSON object.
    """
    if not isinstance(ce, dict):
        raise MalformedMessageError("a CloudEvent must be a JSON object")
    if ce.get("specversion") != SPEC_VERSION:
        raise MalformedMessageError(
            f"unsupported CloudEvents specversion {ce.get('specversion')!r}; expected '1.0'"
        )
    for required in ("id", "source", "type"):
        if not isinstance(ce.get(required), str) or not ce[required]:
            raise MalformedMessageError(f"CloudEvent attribute {required!r} must be a string")
    if "data_base64" in ce:
        raise MalformedMessageError("binary CloudEvent data (data_base64) is not supported")
    headers: dict[str, str] = {}
    packed = ce.get(_HEADERS_EXT)
    if packed is not None:
        try:
            unpacked = orjson.loads(packed)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise MalformedMessageError(f"{_HEADERS_EXT} is not a JSON object: {exc}") from exc
        if not isinstance(unpacked, dict):
            raise MalformedMessageError(f"{_HEADERS_EXT} must be a JSON object of strings")
        headers.update(unpacked)
    for name, value in ce.items():
        if name not in _CORE:
            headers[name] = value if isinstance(value, str) else orjson.dumps(value).decode()
    source = "" if ce.get(_EMPTY_SOURCE_EXT) is True else ce["source"]
    version = ce.get("eventversion", 1)
    if isinstance(version, str) and version.isdigit():
        version = int(version)  # extension values may travel as strings
    if type(version) is not int:
        raise MalformedMessageError(f"eventversion must be an integer, got {version!r}")
    raw = {
        "id": ce["id"],
        "type": ce["type"],
        "version": version,
        "source": source,
        "time": ce.get("time"),
        "correlation_id": ce.get("correlationid") or ce["id"],
        "causation_id": ce.get("causationid"),
        "key": ce.get("partitionkey"),
        "headers": headers,
        "data": ce.get("data"),
    }
    return Envelope.from_mapping(raw)
