"""Event classes, the type registry, upcasters and typed decoding."""

import enum
import functools
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    computed_field,
    field_serializer,
    field_validator,
    model_serializer,
)

from eventflow import (
    DecodeError,
    Envelope,
    Event,
    EventRegistry,
    EventTypeError,
    EventValidationError,
    FutureVersionError,
    UnknownEventTypeError,
    UpcastError,
    upcaster,
)
from eventflow.events import default_registry, to_envelope


class Placed(Event, type="ut.events.placed", version=2):
    order_id: str
    qty: int
    customer_id: str | None = None


class Unversioned(Event, type="ut.events.unversioned"):
    name: str


class _AbstractBase(Event):
    """No type=: an intermediate base, never registered."""

    tenant: str = "t"


class Concrete(_AbstractBase, type="ut.events.concrete"):
    value: int


# A three-version chain, v1 -> v2 -> v3, registered in the default registry.


class ChainV1(Event, type="ut.events.chain", version=1):
    name: str


class ChainV2(Event, type="ut.events.chain", version=2):
    first: str
    last: str


class ChainV3(Event, type="ut.events.chain", version=3):
    first: str
    last: str
    email: str | None


@upcaster("ut.events.chain", from_version=1)
def _split_name(data: dict) -> dict:
    first, _, last = data["name"].partition(" ")
    return {"first": first, "last": last}


@upcaster("ut.events.chain", from_version=2)
def _add_email(data: dict) -> dict:
    return {**data, "email": None}


def env(type_: str, data: dict, version: int = 1) -> Envelope:
    return Envelope.create(type_, data, version=version)


# -- class keywords and registry ---------------------------------------------------------------


def test_class_keywords_set_type_and_version() -> None:
    assert Placed.event_type == "ut.events.placed"
    assert Placed.event_version == 2
    assert Unversioned.event_version == 1
    assert Concrete.event_type == "ut.events.concrete"
    assert Concrete(value=1).tenant == "t"


def test_defined_classes_are_registered() -> None:
    assert default_registry.get("ut.events.placed", 2) is Placed
    assert default_registry.get("ut.events.placed") is Placed
    assert default_registry.get("ut.events.chain") is ChainV3
    assert default_registry.get("ut.events.chain", 1) is ChainV1
    assert default_registry.latest_version("ut.events.chain") == 3
    assert default_registry.types()["ut.events.chain"] == [1, 2, 3]


def test_abstract_bases_are_not_registered() -> None:
    assert _AbstractBase.event_type == ""
    assert all(not t.startswith("_") for t in default_registry.types())
    with pytest.raises(EventTypeError):
        to_envelope(_AbstractBase(), source="s")


def test_events_are_frozen_pydantic_models() -> None:
    placed = Placed(order_id="o", qty=1)
    with pytest.raises(ValidationError):
        placed.qty = 2  # type: ignore[misc]
    assert placed.model_dump() == {"order_id": "o", "qty": 1, "customer_id": None}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"version": 2}, "without type"),
        ({"type": "ut.events.bad..x"}, "non-empty tokens"),
        ({"type": ".ut.events"}, "non-empty tokens"),
        ({"type": "ut.events.*"}, "wildcards"),
        ({"type": "ut.events.>"}, "wildcards"),
        ({"type": "ut events"}, "spaces"),
        ({"type": "ut.events.v0", "version": 0}, "version"),
        ({"type": "ut.events.vs", "version": "2"}, "version"),
    ],
)
def test_bad_class_keywords_raise(kwargs: dict, message: str) -> None:
    with pytest.raises(EventTypeError, match=message):

        class Bad(Event, **kwargs):  # type: ignore[call-arg]
            x: int = 0


def test_duplicate_type_and_version_is_a_clear_error() -> None:
    with pytest.raises(EventTypeError) as info:

        class PlacedAgain(Event, type="ut.events.placed", version=2):
            order_id: str

    text = str(info.value)
    assert "'ut.events.placed'" in text
    assert "version 2" in text
    assert "Placed" in text  # names the class that already has it
    assert "PlacedAgain" in text  # and the newcomer
    assert "another type name or a new version" in text
    assert default_registry.get("ut.events.placed", 2) is Placed  # unchanged


def test_new_version_of_an_existing_type_is_allowed() -> None:
    class UnversionedV9(Event, type="ut.events.unversioned", version=9):
        name: str

    assert default_registry.get("ut.events.unversioned", 9) is UnversionedV9
    assert default_registry.get("ut.events.unversioned", 1) is Unversioned


def test_private_registry_duplicate_and_unknown() -> None:
    reg = EventRegistry()
    reg.register(Placed)
    reg.register(Placed)  # the same class again is harmless
    assert reg.get("ut.events.placed") is Placed
    with pytest.raises(UnknownEventTypeError, match=r"unknown event type 'ut\.events\.nope'"):
        reg.get("ut.events.nope")
    with pytest.raises(UnknownEventTypeError, match=r"known: \[2\]"):
        reg.get("ut.events.placed", 1)


# -- upcasters ---------------------------------------------------------------------------------


def test_upcaster_chain_is_applied_on_decode() -> None:
    event = default_registry.decode(env("ut.events.chain", {"name": "Ada Lovelace"}, 1))
    assert isinstance(event, ChainV3)
    assert event == ChainV3(first="Ada", last="Lovelace", email=None)


def test_upcasters_stop_at_the_target_version() -> None:
    v1 = env("ut.events.chain", {"name": "Grace Hopper"}, 1)
    assert default_registry.decode_as(v1, ChainV2) == ChainV2(first="Grace", last="Hopper")
    v2 = env("ut.events.chain", {"first": "A", "last": "B"}, 2)
    assert default_registry.decode_as(v2, ChainV3) == ChainV3(first="A", last="B", email=None)
    v3 = env("ut.events.chain", {"first": "A", "last": "B", "email": "a@b"}, 3)
    assert default_registry.decode(v3) == ChainV3(first="A", last="B", email="a@b")


def test_registry_upcast_directly() -> None:
    out = default_registry.upcast("ut.events.chain", {"name": "A B"}, 1, 3)
    assert out == {"first": "A", "last": "B", "email": None}
    assert ("ut.events.chain", 1) in default_registry.upcasters()


def test_upcaster_decorator_returns_the_function() -> None:
    assert _split_name({"name": "x y"}) == {"first": "x", "last": "y"}


def test_missing_upcaster_raises_upcast_error() -> None:
    class GapV1(Event, type="ut.events.gap", version=1):
        a: int

    class GapV3(Event, type="ut.events.gap", version=3):
        a: int
        b: int

    reg = EventRegistry()
    reg.register(GapV1)
    reg.register(GapV3)
    reg.add_upcaster("ut.events.gap", 1, lambda d: d)
    with pytest.raises(UpcastError) as info:
        reg.decode(env("ut.events.gap", {"a": 1}, 1))
    text = str(info.value)
    assert "v1 cannot become v3" in text
    assert "from_version=2" in text
    assert info.value.reason == "upcast-failed"
    assert isinstance(info.value, DecodeError)


def test_failing_upcaster_raises_upcast_error() -> None:
    reg = EventRegistry()
    reg.register(ChainV2)

    def broken(data: dict) -> dict:
        raise KeyError("name")

    reg.add_upcaster("ut.events.chain", 1, broken)
    with pytest.raises(UpcastError, match="KeyError"):
        reg.decode(env("ut.events.chain", {}, 1))


def test_upcaster_returning_a_non_dict_raises_upcast_error() -> None:
    reg = EventRegistry()
    reg.register(ChainV2)
    reg.add_upcaster("ut.events.chain", 1, lambda d: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(UpcastError, match="not a dict"):
        reg.decode(env("ut.events.chain", {"name": "a b"}, 1))


def test_upcaster_registration_errors() -> None:
    reg = EventRegistry()
    reg.add_upcaster("ut.events.u", 1, _split_name)
    reg.add_upcaster("ut.events.u", 1, _split_name)  # same function again: fine
    with pytest.raises(EventTypeError, match="already registered"):
        reg.add_upcaster("ut.events.u", 1, _add_email)
    with pytest.raises(EventTypeError, match=">= 1"):
        reg.add_upcaster("ut.events.u", 0, _split_name)


# -- decode errors -----------------------------------------------------------------------------


def test_future_version_raises() -> None:
    with pytest.raises(FutureVersionError) as info:
        default_registry.decode(env("ut.events.chain", {"first": "a"}, 7))
    assert "v7" in str(info.value) and "v3" in str(info.value)
    assert info.value.reason == "future-version"
    with pytest.raises(FutureVersionError):
        default_registry.decode_as(env("ut.events.chain", {"first": "a", "last": "b"}, 3), ChainV2)


def test_validation_failure_names_the_field() -> None:
    with pytest.raises(EventValidationError) as info:
        default_registry.decode(env("ut.events.placed", {"order_id": "o", "qty": "many"}, 2))
    text = str(info.value)
    assert "qty" in text
    assert "Placed" in text
    assert info.value.reason == "invalid-payload"
    with pytest.raises(EventValidationError, match="order_id"):
        default_registry.decode(env("ut.events.placed", {"qty": 1}, 2))


def test_validation_of_upcast_data_names_the_field() -> None:
    # The v1 -> v2 upcaster produces "last" = "" for a one-word name: still valid; a missing
    # "name" makes the upcaster fail instead, and is reported as such.
    with pytest.raises(UpcastError, match="KeyError"):
        default_registry.decode(env("ut.events.chain", {"nom": "x"}, 1))


def test_unknown_type_raises() -> None:
    with pytest.raises(UnknownEventTypeError, match=r"ut\.events\.never") as info:
        default_registry.decode(env("ut.events.never", {}))
    assert info.value.reason == "unknown-type"


# -- to_envelope -------------------------------------------------------------------------------


def test_to_envelope_wraps_an_event() -> None:
    out = to_envelope(
        Placed(order_id="o-1", qty=2),
        source="svc",
        key="o-1",
        headers={"h": "v"},
        correlation_id="c",
        causation_id="p",
    )
    assert uuid.UUID(out.id).version == 7
    assert out.type == "ut.events.placed"
    assert out.version == 2
    assert out.data == {"order_id": "o-1", "qty": 2, "customer_id": None}
    assert out.source == "svc"
    assert out.key == "o-1"
    assert out.correlation_id == "c"
    assert out.causation_id == "p"
    assert out.headers["h"] == "v"
    version, trace_id, span_id, flags = out.headers["traceparent"].split("-")
    assert (version, len(trace_id), len(span_id), flags) == ("00", 32, 16, "01")
    assert default_registry.decode(out) == Placed(order_id="o-1", qty=2)


def test_to_envelope_keeps_an_existing_traceparent_and_passes_envelopes_through() -> None:
    out = to_envelope(Unversioned(name="n"), source="s", headers={"traceparent": "mine"})
    assert out.headers["traceparent"] == "mine"
    assert out.correlation_id == out.id
    assert to_envelope(out, source="ignored") is out


def test_to_envelope_rejects_non_events() -> None:
    with pytest.raises(EventTypeError, match="Event subclass"):
        to_envelope({"a": 1}, source="s")  # type: ignore[arg-type]


# -- publishing copies plain data instead of serializing it -----------------------------------


class _Status(enum.StrEnum):
    OPEN = "open"


class PlainAll(Event, type="ut.events.plain"):
    name: str
    count: int = Field(ge=0)
    flag: bool = False
    note: str | None = None


class WithDatetime(Event, type="ut.events.notplain.time"):
    at: datetime


class WithEnum(Event, type="ut.events.notplain.enum"):
    status: _Status


class WithExcluded(Event, type="ut.events.notplain.excluded"):
    name: str
    secret: str = Field(default="s", exclude=True)


class WithSerializer(Event, type="ut.events.notplain.serializer"):
    name: str

    @field_serializer("name")
    def _upper(self, value: str) -> str:
        return value.upper()


class WithModelSerializer(Event, type="ut.events.notplain.model_serializer"):
    name: str

    @model_serializer
    def _whole(self) -> dict[str, str]:
        return {"renamed": self.name}


class WithComputed(Event, type="ut.events.notplain.computed"):
    name: str

    @computed_field  # type: ignore[prop-decorator]
    @property
    def size(self) -> int:
        return len(self.name)


class WithExtra(Event, type="ut.events.notplain.extra"):
    model_config = ConfigDict(extra="allow")
    name: str


class WithNested(Event, type="ut.events.notplain.nested"):
    tags: list[str]


class WithValidator(Event, type="ut.events.notplain.validator"):
    name: str

    @field_validator("name")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()


class WithCachedProperty(Event, type="ut.events.plain.cached"):
    price: str

    @functools.cached_property
    def amount(self) -> float:
        return float(self.price)


class OnlyComputed(Event, type="ut.events.notplain.only_computed"):
    @computed_field  # type: ignore[prop-decorator]
    @property
    def constant(self) -> int:
        return 1


class PlainChild(PlainAll, type="ut.events.plain.child"):
    extra_note: str = ""


class NotPlainChild(PlainAll, type="ut.events.notplain.child"):
    at: datetime | None = None


@pytest.mark.parametrize(
    "event",
    [
        PlainAll(name="n", count=3, flag=True),
        PlainChild(name="n", count=0, note="x", extra_note="e"),
        WithDatetime(at=datetime(2024, 5, 1, 12, tzinfo=UTC)),
        WithEnum(status=_Status.OPEN),
        WithExcluded(name="n", secret="hidden"),
        WithSerializer(name="n"),
        WithModelSerializer(name="n"),
        WithComputed(name="abc"),
        WithExtra(name="n", more=1),  # type: ignore[call-arg]
        WithNested(tags=["a"]),
        WithValidator(name=" n "),
    ],
    ids=lambda e: type(e).__name__,
)
def test_published_data_is_pydantics_json_form(event: Event) -> None:
    expected = event.model_dump(mode="json")
    out = to_envelope(event, source="s")
    assert out.data == expected
    assert [type(v) for v in out.data.values()] == [type(v) for v in expected.values()]
    assert out.data is not event.__dict__  # a copy: the envelope never aliases the event


def test_an_event_holding_more_than_its_fields_publishes_only_its_fields() -> None:
    event = WithCachedProperty(price="1.5")
    assert event.amount == 1.5  # cached in the instance's __dict__
    assert to_envelope(event, source="s").data == {"price": "1.5"}
    assert to_envelope(OnlyComputed(), source="s").data == {"constant": 1}


def test_an_unvalidated_event_publishes_pydantics_json_form() -> None:
    # model_construct may put anything in the fields: the JSON form comes from pydantic (and
    # App.publish then validates it), never from a copy of whatever the instance holds.
    odd = PlainAll.model_construct(name=_Status.OPEN, count=1)  # type: ignore[arg-type]
    out = to_envelope(odd, source="s")
    assert out.data["name"] == "open" and type(out.data["name"]) is str


def test_a_root_envelope_time_is_the_millisecond_its_id_carries() -> None:
    before = datetime.now(UTC) - timedelta(milliseconds=1)
    envs = [to_envelope(PlainAll(name="n", count=i), source="s") for i in range(2000)]
    envs.append(to_envelope(PlainAll(name="n", count=0), source="s", headers={"h": "v"}))
    after = datetime.now(UTC) + timedelta(milliseconds=10)  # the counter may borrow a few ms
    for out in envs:
        id_ms = int(out.id.replace("-", "")[:12], 16)
        assert out.time == datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=id_ms)
        assert out.time.tzinfo is UTC
        assert before <= out.time <= after


def test_a_continued_envelope_time_is_when_it_was_made_in_utc() -> None:
    before = datetime.now(UTC)
    out = to_envelope(PlainAll(name="n", count=1), source="s", correlation_id="c-1")
    assert out.time.tzinfo is UTC
    assert before <= out.time <= datetime.now(UTC)
