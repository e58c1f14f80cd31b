"""The message envelope, its ids (UUIDv7) and its wire form (one orjson-written JSON object).

The wire form has exactly the envelope's ten fields::

    {"id", "type", "version", "source", "time", "correlation_id", "causation_id",
     "key", "headers", "data"}

``Envelope.from_bytes`` validates by hand for speed (it runs once per consumed message) and
raises :class:`~eventflow.errors.MalformedMessageError` with a precise reason; constructing an
``Envelope(...)`` directly goes through pydantic's validation with the same rules.
"""

from __future__ import annotations

import os
import random
import time as _time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .errors import MalformedMessageError

__all__ = ["Envelope", "new_id", "new_traceparent", "child_traceparent"]

_ORJSON_OPTS = orjson.OPT_UTC_Z
_FIELDS = (
    "id",
    "type",
    "version",
    "source",
    "time",
    "correlation_id",
    "causation_id",
    "key",
    "headers",
    "data",
)

# A private generator, reseeded from os.urandom after fork so child processes diverge.
# Ids need uniqueness, not secrecy: 62 random bits per id on top of the time and counter.
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)
_randbits = _rng.getrandbits
_last_ms = 0
_seq = 0


def new_id() -> str:
    """Return a new UUIDv7 string: time-ordered, monotonic within this process.

    The 12-bit ``rand_a`` field is a counter within one millisecond (RFC 9562 method 1),
    so ids made in one process sort in creation order.
    """
    global _last_ms, _seq
    rnd = _randbits(64)
    ms = _time.time_ns() // 1_000_000
    if ms > _last_ms:
        _last_ms = ms
        _seq = rnd >> 53  # random start in the lower half leaves room to count up
    else:
        _seq += 1
        if _seq > 0xFFF:  # counter exhausted: borrow the next millisecond
            _last_ms += 1
            _seq = 0
    value = (_last_ms << 80) | 0x7000_0000_0000_0000_0000 | (_seq << 64)
    value |= (rnd & 0x3FFF_FFFF_FFFF_FFFF) | 0x8000_0000_0000_0000
    h = "%032x" % value
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def new_traceparent() -> str:
    """Return a new W3C ``traceparent`` header value (new trace, new span, sampled)."""
    return "00-%032x-%016x-01" % (_randbits(128) or 1, _randbits(64) or 1)


def child_traceparent(parent: str | None) -> str:
    """Return a ``traceparent`` in the same trace as ``parent`` with a new span id."""
    if parent and len(parent) == 55 and parent[2] == "-":
        return "%s%016x%s" % (parent[:36], _randbits(64) or 1, parent[52:])
    return new_traceparent()


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    if value.utcoffset():
        return value.astimezone(UTC)
    return value


class Envelope(BaseModel):
    """A versioned message: metadata plus the event's data.

    Frozen. ``correlation_id`` groups every message of one business transaction;
    ``causation_id`` is the id of the message whose handling produced this one.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str = Field(min_length=1)
    type: str = Field(min_length=1)
    version: int = Field(default=1, ge=1)
    source: str = ""
    time: datetime = Field(default_factory=lambda: datetime.now(UTC))
    correlation_id: str = ""
    causation_id: str | None = None
    key: str | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)

    @field_validator("time")
    @classmethod
    def _to_utc(cls, value: datetime) -> datetime:
        return _utc(value)

    @model_validator(mode="after")
    def _default_correlation(self) -> Envelope:
        if not self.correlation_id:
            object.__setattr__(self, "correlation_id", self.id)
        return self

    # -- construction without re-validation ------------------------------------------------

    @classmethod
    def _trusted(cls, fields: dict[str, Any]) -> Envelope:
        """Build from already-checked values (all ten fields), skipping pydantic validation."""
        env = cls.__new__(cls)
        object.__setattr__(env, "__dict__", fields)
        object.__setattr__(env, "__pydantic_fields_set__", _ALL_FIELDS)
        object.__setattr__(env, "__pydantic_extra__", None)
        object.__setattr__(env, "__pydantic_private__", None)
        return env

    @classmethod
    def create(
        cls,
        type: str,
        data: dict[str, Any],
        *,
        version: int = 1,
        source: str = "",
        id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        time: datetime | None = None,
    ) -> Envelope:
        """Build a new envelope with a fresh UUIDv7 id and the current UTC time.

        ``correlation_id`` defaults to the new id: a new business transaction starts here.
        """
        if not type:
            raise MalformedMessageError("an envelope needs a non-empty type")
        env_id = id or new_id()
        return cls._trusted(
            {
                "id": env_id,
                "type": type,
                "version": version,
                "source": source,
                "time": _utc(time) if time is not None else datetime.now(UTC),
                "correlation_id": correlation_id or env_id,
                "causation_id": causation_id,
                "key": key,
                "headers": dict(headers) if headers else {},
                "data": data,
            }
        )

    # -- wire form ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Return the ten wire fields as a plain dict (``time`` stays a datetime)."""
        d = self.__dict__
        return {name: d[name] for name in _FIELDS}

    def to_bytes(self) -> bytes:
        """Encode as one JSON object of exactly the ten envelope fields (orjson, UTC 'Z' time)."""
        return orjson.dumps(self.__dict__, option=_ORJSON_OPTS)

    @classmethod
    def from_bytes(cls, payload: bytes | bytearray | memoryview | str) -> Envelope:
        """Decode the wire form; raise ``MalformedMessageError`` saying what is wrong."""
        try:
            raw = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise MalformedMessageError(f"payload is not valid JSON: {exc}") from exc
        return cls.from_mapping(raw)

    @classmethod
    def from_mapping(cls, raw: Any) -> Envelope:
        """Validate a decoded JSON object as an envelope (the checks ``from_bytes`` makes)."""
        if type(raw) is not dict:
            raise MalformedMessageError(
                f"payload is a JSON {type(raw).__name__}, not an envelope object"
            )
        get = raw.get
        env_id = get("id")
        if type(env_id) is not str or not env_id:
            raise MalformedMessageError("envelope field 'id' must be a non-empty string")
        etype = get("type")
        if type(etype) is not str or not etype:
            raise MalformedMessageError("envelope field 'type' must be a non-empty string")
        version = get("version", 1)
        if type(version) is not int or version < 1:
            raise MalformedMessageError("envelope field 'version' must be an integer >= 1")
        source = get("source", "")
        if type(source) is not str:
            raise MalformedMessageError("envelope field 'source' must be a string")
        when = get("time")
        if when is None:
            stamp = datetime.now(UTC)
        elif type(when) is str:
            try:
                stamp = _utc(datetime.fromisoformat(when))
            except ValueError as exc:
                raise MalformedMessageError(
                    f"envelope field 'time' is not an ISO 8601 timestamp: {when!r}"
                ) from exc
        else:
            raise MalformedMessageError("envelope field 'time' must be an ISO 8601 string")
        correlation = get("correlation_id") or env_id
        causation = get("causation_id")
        key = get("key")
        if type(correlation) is not str or (causation is not None and type(causation) is not str):
            raise MalformedMessageError("envelope correlation/causation ids must be strings")
        if key is not None and type(key) is not str:
            raise MalformedMessageError("envelope field 'key' must be a string or null")
        headers = get("headers")
        if headers is None:
            headers = {}
        elif type(headers) is not dict or not all(type(v) is str for v in headers.values()):
            raise MalformedMessageError("envelope field 'headers' must map strings to strings")
        data = get("data")
        if data is None:
            data = {}
        elif type(data) is not dict:
            raise MalformedMessageError("envelope field 'data' must be a JSON object")
        return cls._trusted(
            {
                "id": env_id,
                "type": etype,
                "version": version,
                "source": source,
                "time": stamp,
                "correlation_id": correlation,
                "causation_id": causation,
                "key": key,
                "headers": headers,
                "data": data,
            }
        )


_ALL_FIELDS = frozenset(_FIELDS)
