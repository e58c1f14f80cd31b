"""CloudEvents 1.0 structured JSON: lossless both ways, valid extension names."""

import re
from datetime import UTC, datetime

import orjson
import pytest

from eventflow import Envelope, MalformedMessageError
from eventflow.cloudevents import from_cloudevent, to_cloudevent
from eventflow.envelope import new_traceparent
from eventflow.headers import COMPENSATES_HEADER

# Context attributes defined by the CloudEvents 1.0 spec itself; every other key is an extension.
SPEC_ATTRIBUTES = {
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
}
EXTENSION_NAME = re.compile(r"^[a-z0-9]{1,20}$")

ODD_HEADERS = {
    "traceparent": new_traceparent(),
    "tracestate": "vendor=1",
    "tenant": "acme",
    "Content-Type": "text/plain",
    "x-request-id": "r-1",
    "UPPER": "u",
    "with space": "s",
    "dotted.name": "d",
    "a" * 21: "too long for an extension",
    "b" * 20: "exactly twenty",
    "ünïcode": "ü",
    "": "empty name",
    "id": "a header called id",
    "data": "a header called data",
    "source": "a header called source",
    "specversion": "0.3",
    "eventversion": "not the version",
    "correlationid": "not the correlation",
    "causationid": "not the causation",
    "partitionkey": "not the key",
    "eventflowheaders": "{not json",
    "eventflowemptysource": "true",
    "subject": "a header called subject",
    "42": "digits only",
}


def envelope(**overrides: object) -> Envelope:
    fields: dict[str, object] = {
        "type": "ut.ce.order.placed",
        "data": {"order_id": "o-1", "qty": 3, "tags": ["a", "b"], "none": None},
        "version": 4,
        "source": "inventory",
        "correlation_id": "corr-9",
        "causation_id": "cause-9",
        "key": "o-1",
        "headers": {"traceparent": new_traceparent(), "tenant": "acme"},
        "time": datetime(2024, 5, 1, 12, 0, 0, 250000, tzinfo=UTC),
    }
    fields.update(overrides)
    return Envelope.create(**fields)  # type: ignore[arg-type]


def through_json(ce: dict[str, object]) -> dict[str, object]:
    """What a receiver sees: the CloudEvent serialised and parsed again."""
    return orjson.loads(orjson.dumps(ce))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "env",
    [
        pytest.param(envelope(), id="full"),
        pytest.param(envelope(headers=ODD_HEADERS), id="odd-headers"),
        pytest.param(envelope(source=""), id="empty-source"),
        pytest.param(envelope(source="eventflow"), id="source-named-eventflow"),
        pytest.param(envelope(key=None, causation_id=None), id="no-key-no-causation"),
        pytest.param(envelope(key="", causation_id="c"), id="empty-key"),
        pytest.param(envelope(headers={}), id="no-headers"),
        pytest.param(envelope(data={}), id="empty-data"),
        pytest.param(Envelope.create("ut.ce.min", {}), id="minimal"),
        pytest.param(
            Envelope(id="foreign-id", type="ut.ce.foreign", time=datetime(2020, 1, 1)),
            id="foreign-id",
        ),
    ],
)
def test_envelope_to_cloudevent_and_back_is_lossless(env: Envelope) -> None:
    ce = to_cloudevent(env)
    assert from_cloudevent(ce) == env
    again = from_cloudevent(through_json(ce))
    assert again == env
    assert again.headers == env.headers
    assert again.source == env.source
    assert again.key == env.key
    assert again.causation_id == env.causation_id
    assert to_cloudevent(again) == ce


def test_cloudevent_has_the_required_attributes() -> None:
    env = envelope()
    ce = to_cloudevent(env)
    assert ce["specversion"] == "1.0"
    assert ce["id"] == env.id
    assert ce["type"] == env.type
    assert ce["source"] == "inventory"
    assert ce["datacontenttype"] == "application/json"
    assert ce["data"] == env.data
    assert ce["time"] == "2024-05-01T12:00:00.250000Z"
    assert ce["eventversion"] == 4
    assert ce["correlationid"] == "corr-9"
    assert ce["causationid"] == "cause-9"
    assert ce["partitionkey"] == "o-1"
    assert ce["traceparent"] == env.headers["traceparent"]
    assert ce["tenant"] == "acme"


def test_empty_source_is_a_non_empty_uri_reference_on_the_wire() -> None:
    ce = to_cloudevent(envelope(source=""))
    assert isinstance(ce["source"], str) and ce["source"]
    assert from_cloudevent(ce).source == ""


def test_absent_optionals_are_absent_attributes() -> None:
    ce = to_cloudevent(envelope(key=None, causation_id=None, headers={}))
    assert "causationid" not in ce
    assert "partitionkey" not in ce
    assert "eventflowheaders" not in ce


@pytest.mark.parametrize(
    "headers",
    [ODD_HEADERS, {"Z": "1"}, {"traceparent": "x"}, {}],
    ids=["odd", "upper", "tp", "none"],
)
def test_extension_names_are_lowercase_alphanumeric_up_to_20(headers: dict[str, str]) -> None:
    ce = to_cloudevent(envelope(headers=headers, source=""))
    extensions = set(ce) - SPEC_ATTRIBUTES
    assert extensions  # eventversion, correlationid, ... at least
    for name in extensions:
        assert EXTENSION_NAME.match(name), name
    # Extension values are strings, integers or booleans (CloudEvents type system).
    for name in extensions:
        assert isinstance(ce[name], str | int | bool), name


def test_headers_that_are_not_valid_extension_names_travel_packed() -> None:
    ce = to_cloudevent(envelope(headers=ODD_HEADERS))
    packed = orjson.loads(ce["eventflowheaders"])
    assert packed["Content-Type"] == "text/plain"
    assert packed["a" * 21] == "too long for an extension"
    assert packed["id"] == "a header called id"
    assert ce["b" * 20] == "exactly twenty"
    assert ce["42"] == "digits only"
    # A header never overwrites a CloudEvents attribute.
    assert ce["specversion"] == "1.0"
    assert ce["id"] != "a header called id"
    assert ce["eventversion"] == 4


def test_a_compensations_header_survives_the_cloudevents_mapping() -> None:
    """``eventflow-compensates`` is no valid extension name (a hyphen): it travels packed
    in ``eventflowheaders`` and comes back as the same envelope header, beside others."""
    env = Envelope.create(
        "shop.stock.release",
        {"order_id": "o-1"},
        key="o-1",
        headers={COMPENSATES_HEADER: "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "traceparent": "t"},
    )
    ce = orjson.loads(orjson.dumps(to_cloudevent(env)))  # through JSON, as on the wire
    assert orjson.loads(ce["eventflowheaders"]) == {
        COMPENSATES_HEADER: env.headers[COMPENSATES_HEADER]
    }
    back = from_cloudevent(ce)
    assert back == env
    assert back.headers[COMPENSATES_HEADER] == "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"


def test_foreign_cloudevent_with_unknown_extensions() -> None:
    foreign = {
        "specversion": "1.0",
        "id": "A234-1234-1234",
        "source": "https://github.com/cloudevents/spec/pull",
        "type": "com.github.pull_request.opened",
        "time": "2018-04-05T17:31:00Z",
        "subject": "123",
        "datacontenttype": "application/json",
        "comexampleextension1": "value",
        "comexampleothervalue": 5,
        "sampled": True,
        "data": {"number": 123},
    }
    env = from_cloudevent(foreign)
    assert env.id == "A234-1234-1234"
    assert env.type == "com.github.pull_request.opened"
    assert env.source == "https://github.com/cloudevents/spec/pull"
    assert env.version == 1
    assert env.correlation_id == env.id
    assert env.causation_id is None
    assert env.key is None
    assert env.time == datetime(2018, 4, 5, 17, 31, tzinfo=UTC)
    assert env.data == {"number": 123}
    assert env.headers == {
        "comexampleextension1": "value",
        "comexampleothervalue": "5",
        "sampled": "true",
    }
    # And it goes on as an ordinary envelope.
    assert Envelope.from_bytes(env.to_bytes()) == env
    assert from_cloudevent(to_cloudevent(env)) == env


def test_foreign_eventversion_may_be_a_digit_string() -> None:
    ce = {"specversion": "1.0", "id": "1", "source": "s", "type": "t", "eventversion": "3"}
    assert from_cloudevent(ce).version == 3


def test_foreign_cloudevent_without_time_or_data() -> None:
    before = datetime.now(UTC)
    env = from_cloudevent({"specversion": "1.0", "id": "1", "source": "/s", "type": "t.x"})
    assert env.time >= before
    assert env.data == {}
    assert env.headers == {}


@pytest.mark.parametrize(
    ("ce", "message"),
    [
        ({"specversion": "0.3", "id": "1", "source": "s", "type": "t"}, "specversion"),
        ({"id": "1", "source": "s", "type": "t"}, "specversion"),
        ({"specversion": "1.0", "source": "s", "type": "t"}, "'id'"),
        ({"specversion": "1.0", "id": "", "source": "s", "type": "t"}, "'id'"),
        ({"specversion": "1.0", "id": "1", "type": "t"}, "'source'"),
        ({"specversion": "1.0", "id": "1", "source": "s"}, "'type'"),
        ({"specversion": "1.0", "id": 1, "source": "s", "type": "t"}, "'id'"),
        (
            {"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data_base64": "AA=="},
            "data_base64",
        ),
        ({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data": "text"}, "data"),
        ({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data": [1]}, "data"),
        ({"specversion": "1.0", "id": "1", "source": "s", "type": "t", "time": "nope"}, "time"),
        (
            {"specversion": "1.0", "id": "1", "source": "s", "type": "t", "eventflowheaders": "{"},
            "eventflowheaders",
        ),
        (
            {"specversion": "1.0", "id": "1", "source": "s", "type": "t", "eventversion": 0},
            "version",
        ),
    ],
)
def test_invalid_cloudevents_raise_malformed(ce: dict[str, object], message: str) -> None:
    with pytest.raises(MalformedMessageError) as info:
        from_cloudevent(ce)
    assert message in str(info.value)


def test_non_dict_cloudevent_is_malformed() -> None:
    with pytest.raises(MalformedMessageError):
        from_cloudevent([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "extra",
    [{"eventversion": "abc"}, {"eventversion": None}, {"eventflowheaders": "[1]"}],
    ids=["text-version", "null-version", "packed-headers-array"],  # bug B3, fixed
)
def test_foreign_bad_attributes_raise_malformed(extra: dict[str, object]) -> None:
    ce = {"specversion": "1.0", "id": "1", "source": "s", "type": "t", **extra}
    with pytest.raises(MalformedMessageError):
        from_cloudevent(ce)
