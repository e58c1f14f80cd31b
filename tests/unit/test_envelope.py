"""Envelope: wire form, UUIDv7 ids, UTC time, malformed input."""

import itertools
import os
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import orjson
import pytest
from pydantic import ValidationError

from eventflow import Envelope, MalformedMessageError
from eventflow.envelope import (
    child_traceparent,
    new_id,
    new_root,
    new_traceparent,
    traceparent_for,
)

FIELDS = {
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
}


def full_envelope() -> Envelope:
    return Envelope.create(
        "ut.env.order.placed",
        {"order_id": "o-1", "qty": 2, "nested": {"list": [1, 2.5, None, "ü"]}, "flag": True},
        version=3,
        source="inventory",
        correlation_id="corr-1",
        causation_id="cause-1",
        key="o-1",
        headers={"traceparent": new_traceparent(), "x-tenant": "acme", "Odd Name!": "v"},
        time=datetime(2024, 5, 1, 12, 30, 15, 123456, tzinfo=UTC),
    )


# -- wire form -------------------------------------------------------------------------------


def test_round_trip_keeps_every_field() -> None:
    env = full_envelope()
    decoded = Envelope.from_bytes(env.to_bytes())
    assert decoded == env
    assert decoded.to_dict() == env.to_dict()
    assert decoded.headers == env.headers
    assert decoded.data == env.data
    assert decoded.time == env.time


def test_wire_form_is_one_object_of_exactly_the_ten_fields() -> None:
    raw = orjson.loads(full_envelope().to_bytes())
    assert isinstance(raw, dict)
    assert set(raw) == FIELDS
    assert raw["version"] == 3
    assert raw["key"] == "o-1"
    assert raw["causation_id"] == "cause-1"
    assert raw["time"] == "2024-05-01T12:30:15.123456Z"


def test_minimal_envelope_round_trips_with_nulls() -> None:
    env = Envelope.create("ut.env.min", {})
    raw = orjson.loads(env.to_bytes())
    assert set(raw) == FIELDS
    assert raw["causation_id"] is None
    assert raw["key"] is None
    assert raw["headers"] == {}
    assert raw["data"] == {}
    assert Envelope.from_bytes(env.to_bytes()) == env


def test_from_bytes_accepts_str_bytearray_and_memoryview() -> None:
    env = full_envelope()
    wire = env.to_bytes()
    assert Envelope.from_bytes(wire.decode()) == env
    assert Envelope.from_bytes(bytearray(wire)) == env
    assert Envelope.from_bytes(memoryview(wire)) == env


def test_pydantic_constructed_envelope_equals_decoded() -> None:
    env = Envelope(
        id="0190b6c8-0000-7000-8000-000000000001",
        type="ut.env.pyd",
        version=2,
        source="svc",
        time=datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC),
        correlation_id="c",
        causation_id="d",
        key="k",
        headers={"a": "b"},
        data={"x": [1, 2]},
    )
    decoded = Envelope.from_bytes(env.to_bytes())
    assert decoded == env
    assert env == decoded
    assert set(orjson.loads(env.to_bytes())) == FIELDS


def test_pydantic_validated_mapping_equals_from_bytes() -> None:
    raw = {
        "id": "foreign-1",
        "type": "ut.env.foreign",
        "version": 1,
        "source": "other",
        "time": "2024-03-04T05:06:07+02:00",
        "correlation_id": "c-1",
        "causation_id": None,
        "key": None,
        "headers": {"h": "v"},
        "data": {"a": 1},
    }
    assert Envelope.model_validate(raw) == Envelope.from_bytes(orjson.dumps(raw))


def test_envelope_is_frozen() -> None:
    env = Envelope.from_bytes(full_envelope().to_bytes())
    with pytest.raises(ValidationError):
        env.id = "other"  # type: ignore[misc]
    created = Envelope(id="x", type="ut.env.frozen")
    with pytest.raises(ValidationError):
        created.type = "y"  # type: ignore[misc]


def test_unknown_wire_fields_are_ignored() -> None:
    raw = {"id": "i", "type": "ut.env.extra", "extra": 1}
    env = Envelope.from_bytes(orjson.dumps(raw))
    assert set(orjson.loads(env.to_bytes())) == FIELDS


def test_defaults_when_optional_fields_are_missing() -> None:
    before = datetime.now(UTC)
    env = Envelope.from_bytes(b'{"id": "abc", "type": "ut.env.defaults"}')
    assert env.version == 1
    assert env.source == ""
    assert env.headers == {}
    assert env.data == {}
    assert env.key is None
    assert env.causation_id is None
    assert env.time >= before - timedelta(seconds=1)
    assert env.time.utcoffset() == timedelta(0)


# -- ids -------------------------------------------------------------------------------------


def test_new_ids_are_uuid_v7_with_rfc_variant() -> None:
    for _ in range(200):
        value = uuid.UUID(new_id())
        assert value.version == 7
        assert value.variant == uuid.RFC_4122


def test_new_id_embeds_the_current_unix_millisecond() -> None:
    before = time.time_ns() // 1_000_000
    ms = int(new_id().replace("-", "")[:12], 16)
    after = time.time_ns() // 1_000_000
    # The counter may borrow a millisecond or two when many ids are made in one ms.
    assert before <= ms <= after + 5


def test_new_ids_are_unique_and_monotonic_within_a_process() -> None:
    ids = [new_id() for _ in range(20_000)]  # several share a millisecond: the counter runs
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    as_ints = [uuid.UUID(i).int for i in ids]
    assert all(a < b for a, b in itertools.pairwise(as_ints))


def test_ids_made_on_several_threads_stay_ordered_per_thread() -> None:
    """A thread switch inside id generation must not mix one id's millisecond with
    another's counter (switching as often as the interpreter allows)."""
    per_thread: list[list[str]] = [[] for _ in range(4)]

    def make(out: list[str]) -> None:
        for _ in range(10_000):
            out.append(new_id())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=make, args=(out,)) for out in per_thread]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    for out in per_thread:
        assert out == sorted(out) and len(set(out)) == len(out)
    stamps = [i[:18] for out in per_thread for i in out]  # millisecond + counter
    assert len(set(stamps)) == len(stamps)


def test_new_root_matches_traceparent_for_its_id() -> None:
    for _ in range(1000):
        env_id, root = new_root()
        assert uuid.UUID(env_id).version == 7 and uuid.UUID(env_id).variant == uuid.RFC_4122
        assert root == traceparent_for(env_id, env_id)


def test_created_envelopes_get_uuid_v7_ids_and_own_correlation() -> None:
    a = Envelope.create("ut.env.ids", {})
    b = Envelope.create("ut.env.ids", {})
    assert a.id != b.id
    assert uuid.UUID(a.id).version == 7
    assert a.correlation_id == a.id
    assert a.causation_id is None


@pytest.mark.parametrize(
    "foreign_id", ["order-42", "x", "🙂", "00000000-0000-4000-8000-000000000000"]
)
def test_foreign_ids_may_be_any_non_empty_string(foreign_id: str) -> None:
    env = Envelope.from_bytes(orjson.dumps({"id": foreign_id, "type": "ut.env.foreign"}))
    assert env.id == foreign_id
    assert env.correlation_id == foreign_id
    assert Envelope(id=foreign_id, type="ut.env.foreign").id == foreign_id


def test_correlation_defaults_to_id_on_every_path() -> None:
    assert Envelope(id="i-1", type="ut.env.c").correlation_id == "i-1"
    assert Envelope(id="i-1", type="ut.env.c", correlation_id="").correlation_id == "i-1"
    assert Envelope.from_bytes(b'{"id":"i-2","type":"t"}').correlation_id == "i-2"
    raw = b'{"id":"i-3","type":"t","correlation_id":null}'
    assert Envelope.from_bytes(raw).correlation_id == "i-3"
    assert Envelope.create("t", {}, id="i-4").correlation_id == "i-4"
    kept = Envelope.create("t", {}, correlation_id="given")
    assert kept.correlation_id == "given"
    assert Envelope.from_bytes(kept.to_bytes()).correlation_id == "given"


def test_traceparent_helpers_follow_w3c_format() -> None:
    parent = new_traceparent()
    version, trace_id, span_id, flags = parent.split("-")
    assert (version, flags) == ("00", "01")
    assert len(trace_id) == 32 and len(span_id) == 16
    child = child_traceparent(parent)
    assert child.split("-")[1] == trace_id
    assert child.split("-")[2] != span_id
    assert len(child) == 55
    assert child_traceparent(None).split("-")[1] != trace_id
    assert child_traceparent("garbage").startswith("00-")


# -- time ------------------------------------------------------------------------------------


def test_created_time_is_utc_now() -> None:
    before = datetime.now(UTC)
    env = Envelope.create("ut.env.time", {})
    after = datetime.now(UTC)
    assert env.time.tzinfo == UTC
    assert before <= env.time <= after


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ("2024-05-01T12:00:00Z", datetime(2024, 5, 1, 12, tzinfo=UTC)),
        ("2024-05-01T12:00:00+00:00", datetime(2024, 5, 1, 12, tzinfo=UTC)),
        ("2024-05-01T14:00:00+02:00", datetime(2024, 5, 1, 12, tzinfo=UTC)),
        ("2024-05-01T07:00:00.5-05:00", datetime(2024, 5, 1, 12, 0, 0, 500000, tzinfo=UTC)),
        ("2024-05-01T12:00:00", datetime(2024, 5, 1, 12, tzinfo=UTC)),  # naive: taken as UTC
    ],
)
def test_decoded_time_is_utc(wire: str, expected: datetime) -> None:
    env = Envelope.from_bytes(orjson.dumps({"id": "i", "type": "t", "time": wire}))
    assert env.time == expected
    assert env.time.utcoffset() == timedelta(0)
    assert env.time.tzinfo == UTC
    assert orjson.loads(env.to_bytes())["time"].endswith("Z")


def test_constructed_time_is_converted_to_utc() -> None:
    plus2 = timezone(timedelta(hours=2))
    env = Envelope(id="i", type="t", time=datetime(2024, 5, 1, 14, tzinfo=plus2))
    assert env.time == datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert env.time.utcoffset() == timedelta(0)
    naive = Envelope(id="i", type="t", time=datetime(2024, 5, 1, 12))
    assert naive.time == datetime(2024, 5, 1, 12, tzinfo=UTC)
    created = Envelope.create("t", {}, time=datetime(2024, 5, 1, 14, tzinfo=plus2))
    assert created.time.hour == 12
    assert created.time.utcoffset() == timedelta(0)


def test_zero_offset_named_zone_becomes_utc() -> None:
    # Bug B4 (fixed): a zero-offset named zone used to stay as it was.
    london_winter = datetime(2024, 1, 1, 9, tzinfo=ZoneInfo("Europe/London"))
    env = Envelope.create("t", {}, time=london_winter)
    assert env.time == london_winter
    assert env.time.tzinfo is UTC


# -- malformed input -------------------------------------------------------------------------

GOOD = {"id": "i-1", "type": "ut.env.bad"}


def _with(**changes: object) -> bytes:
    raw = {**GOOD, **changes}
    return orjson.dumps({k: v for k, v in raw.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        pytest.param(b"not json at all", "not valid JSON", id="not-json"),
        pytest.param(b"", "not valid JSON", id="empty"),
        pytest.param(b"\xff\xfe\x00", "not valid JSON", id="not-utf8"),
        pytest.param(b'{"id": "x", "type": ', "not valid JSON", id="truncated"),
        pytest.param(b"[1, 2, 3]", "JSON list", id="json-array"),
        pytest.param(b'"a string"', "JSON str", id="json-string"),
        pytest.param(b"42", "JSON int", id="json-number"),
        pytest.param(b"null", "JSON NoneType", id="json-null"),
        pytest.param(_with(id=_DROP), "'id'", id="missing-id"),
        pytest.param(_with(id=""), "'id'", id="empty-id"),
        pytest.param(_with(id=7), "'id'", id="int-id"),
        pytest.param(_with(type=_DROP), "'type'", id="missing-type"),
        pytest.param(_with(type=""), "'type'", id="empty-type"),
        pytest.param(_with(type=["a"]), "'type'", id="list-type"),
        pytest.param(_with(version="2"), "'version'", id="str-version"),
        pytest.param(_with(version=0), "'version'", id="zero-version"),
        pytest.param(_with(version=-1), "'version'", id="negative-version"),
        pytest.param(_with(version=1.5), "'version'", id="float-version"),
        pytest.param(_with(version=True), "'version'", id="bool-version"),
        pytest.param(_with(source=5), "'source'", id="int-source"),
        pytest.param(_with(headers=["a"]), "'headers'", id="list-headers"),
        pytest.param(_with(headers={"a": 1}), "'headers'", id="int-header-value"),
        pytest.param(_with(headers={"a": None}), "'headers'", id="null-header-value"),
        pytest.param(_with(headers="a=b"), "'headers'", id="str-headers"),
        pytest.param(_with(data=[1, 2]), "'data'", id="list-data"),
        pytest.param(_with(data="payload"), "'data'", id="str-data"),
        pytest.param(_with(data=3), "'data'", id="int-data"),
        pytest.param(_with(time="yesterday"), "'time'", id="bad-time-text"),
        pytest.param(_with(time="2024-13-45T99:00:00Z"), "'time'", id="bad-time-values"),
        pytest.param(_with(time=1714564800), "'time'", id="numeric-time"),
        pytest.param(_with(key=5), "'key'", id="int-key"),
        pytest.param(_with(correlation_id=5), "correlation", id="int-correlation"),
        pytest.param(_with(causation_id=["x"]), "causation", id="list-causation"),
    ],
)
def test_malformed_input_raises_with_a_useful_message(payload: bytes, message: str) -> None:
    with pytest.raises(MalformedMessageError) as info:
        Envelope.from_bytes(payload)
    assert message in str(info.value)
    assert info.value.reason == "malformed"


FULL = orjson.loads(Envelope.create("ut.env.full", {"a": 1}, key="k").to_bytes())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("id", "", "'id'"),
        ("id", 1, "'id'"),
        ("type", None, "'type'"),
        ("version", 0, "'version'"),
        ("version", "1", "'version'"),
        ("version", False, "'version'"),
        ("source", None, "'source'"),
        ("time", "not a time", "'time'"),
        ("time", 0, "'time'"),
        ("correlation_id", 3, "correlation"),
        ("causation_id", 3, "causation"),
        ("key", 3, "'key'"),
        ("headers", {"a": 1}, "'headers'"),
        ("headers", [], "'headers'"),
        ("data", [], "'data'"),
        ("data", "x", "'data'"),
    ],
)
def test_malformed_complete_envelopes_raise(field: str, value: object, message: str) -> None:
    """The same checks on a message with all ten fields (eventflow's own wire shape)."""
    raw = {**FULL, field: value}
    assert set(raw) == FIELDS
    with pytest.raises(MalformedMessageError) as info:
        Envelope.from_bytes(orjson.dumps(raw))
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("correlation_id", "", "id"),  # empty correlation: the envelope's own id
        ("correlation_id", None, "id"),
        ("headers", None, {}),
        ("data", None, {}),
        ("time", "2024-05-01T14:00:00+02:00", datetime(2024, 5, 1, 12, tzinfo=UTC)),
    ],
)
def test_complete_envelopes_normalise_like_partial_ones(
    field: str, value: object, expected: object
) -> None:
    raw = {**FULL, field: value}
    env = Envelope.from_bytes(orjson.dumps(raw))
    got = getattr(env, field)
    assert got == (env.id if expected == "id" else expected)
    partial = {k: v for k, v in raw.items() if k != "source"}
    assert Envelope.from_bytes(orjson.dumps(partial)) == env


def test_malformed_error_is_a_decode_error() -> None:
    from eventflow import DecodeError, EventflowError

    with pytest.raises(DecodeError):
        Envelope.from_bytes(b"{")
    assert issubclass(MalformedMessageError, EventflowError)


def test_pydantic_construction_applies_the_same_rules() -> None:
    with pytest.raises(ValidationError):
        Envelope(id="", type="t")
    with pytest.raises(ValidationError):
        Envelope(id="i", type="")
    with pytest.raises(ValidationError):
        Envelope(id="i", type="t", version=0)
    with pytest.raises(ValidationError):
        Envelope(id="i", type="t", headers={"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ValidationError):
        Envelope(id="i", type="t", data=[1])  # type: ignore[arg-type]


def test_create_rejects_an_empty_type() -> None:
    with pytest.raises(MalformedMessageError, match="type"):
        Envelope.create("", {})


def test_trusted_envelopes_carry_the_pydantic_state_of_validated_ones() -> None:
    env = Envelope.create("ut.env.state", {"a": 1}, key="k", headers={"h": "v"})
    validated = Envelope.model_validate(env.to_dict())
    assert env == validated
    assert env.model_fields_set == validated.model_fields_set == FIELDS
    assert env.__pydantic_extra__ is None and env.__pydantic_private__ is None
    assert env.model_dump() == validated.model_dump()


def test_an_envelope_subclass_builds_its_own_class() -> None:
    class Tagged(Envelope):
        """A user's subclass (no new fields)."""

    made = Tagged.create("ut.env.sub", {"a": 1})
    assert type(made) is Tagged
    assert type(Tagged.from_bytes(made.to_bytes())) is Tagged
    assert type(made.model_copy(update={"key": "k"})) is Tagged
    assert type(Envelope.from_bytes(made.to_bytes())) is Envelope


def test_a_forked_child_makes_other_ids_than_its_parent() -> None:
    new_id()  # the parent holds random digits drawn in advance
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids, then exit without running pytest's teardown
        try:
            os.write(write_end, "\n".join(new_id() for _ in range(200)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child = pipe.read().split("\n")
    os.waitpid(pid, 0)
    parent = [new_id() for _ in range(200)]
    assert len(child) == 200
    # The random 62 bits (the last two groups) must differ, not just the counter.
    assert not {i[19:] for i in child} & {i[19:] for i in parent}
