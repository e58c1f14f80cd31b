"""The NATS adapter's broker headers: the envelope id travels once, as ``Nats-Msg-Id``, and
the key once, in the envelope where it carries it."""

from __future__ import annotations

from eventflow.adapters.nats.delivery import (
    IN_PAYLOAD,
    MSG_ID_HEADER,
    NO_KEY_HEADER,
    NO_MESSAGE_ID,
    NatsDelivery,
    payload_key,
    split_headers,
    wire_headers,
)
from eventflow.envelope import Envelope
from eventflow.headers import KEY_HEADER, MESSAGE_ID_HEADER, SEND_ID_HEADER


def _delivered(headers: dict[str, str] | None, key: str | None, payload: bytes) -> NatsDelivery:
    """What a consumer gets for a publish of ``payload`` with ``key`` and ``headers``."""
    got, out = split_headers(wire_headers(headers, key, payload))
    return NatsDelivery(None, "reply", "topic", payload, got, out, 1, 1, 1, 0)  # type: ignore[arg-type]


def _envelope(key: str | None, data: dict[str, object] | None = None) -> bytes:
    return Envelope(id="e-1", type="t", version=1, source="s", key=key, data=data or {}).to_bytes()


def test_the_envelope_id_comes_back_from_the_msg_id() -> None:
    key, headers = split_headers({MSG_ID_HEADER: "e-1", KEY_HEADER: "k", "a": "b"})
    assert key == "k"
    assert headers == {"a": "b", MESSAGE_ID_HEADER: "e-1"}


def test_a_resend_keeps_its_envelope_id_and_send_id() -> None:
    key, headers = split_headers(
        {MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1", MSG_ID_HEADER: "s-1"}
    )
    assert key is IN_PAYLOAD  # no key header: the payload's, if it names one
    assert headers == {MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1"}


def test_a_publish_without_an_envelope_id_is_delivered_without_one() -> None:
    _, headers = split_headers({MESSAGE_ID_HEADER: NO_MESSAGE_ID, MSG_ID_HEADER: "f00d", "a": "b"})
    assert headers == {"a": "b"}


def test_no_headers() -> None:
    assert split_headers(None) == (IN_PAYLOAD, {})
    assert split_headers({}) == (IN_PAYLOAD, {})
    assert _delivered(None, None, b"ping").key is None


def test_the_headers_of_a_publish_come_back_as_they_were_published() -> None:
    for headers, key in [
        ({MESSAGE_ID_HEADER: "e-1"}, "k"),
        ({MESSAGE_ID_HEADER: "e-1", "a": "b"}, None),
        ({MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1"}, "k"),
        ({SEND_ID_HEADER: "s-1"}, "k"),  # a replay of a letter that had no envelope id
        ({"a": "b"}, "k"),
        ({}, None),
    ]:
        for payload in (b"raw", _envelope(key), _envelope("other"), _envelope(None)):
            d = _delivered(headers, key, payload)
            assert (d.key, d.headers) == (key, headers)


def test_the_envelope_id_goes_once_as_the_msg_id() -> None:
    wire = wire_headers({MESSAGE_ID_HEADER: "e-1"}, "k", b"raw")
    assert wire == {MSG_ID_HEADER: "e-1", KEY_HEADER: "k"}
    resend = wire_headers({MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1"}, None, b"raw")
    assert resend[MSG_ID_HEADER] == "s-1" and resend[MESSAGE_ID_HEADER] == "e-1"
    anonymous = wire_headers(None, None, b"raw")
    assert anonymous[MESSAGE_ID_HEADER] == NO_MESSAGE_ID and anonymous[MSG_ID_HEADER]


def test_the_key_goes_once_in_the_envelope() -> None:
    assert wire_headers({MESSAGE_ID_HEADER: "e-1"}, "k-1", _envelope("k-1")) == {
        MSG_ID_HEADER: "e-1"
    }
    d = _delivered({MESSAGE_ID_HEADER: "e-1"}, "k-1", _envelope("k-1"))
    assert d.key == "k-1" and d.again().key == "k-1"


def test_a_key_the_payload_does_not_give_goes_as_a_header() -> None:
    for key, payload in [
        ("k", b"raw"),
        ("k", _envelope("other")),
        ("k", _envelope(None)),
        ('a"b', _envelope('a"b')),  # the rule stops at the quote: JSON escapes it
        ("k", b',"key":"k'),  # no closing quote
    ]:
        assert wire_headers(None, key, payload)[KEY_HEADER] == key
        assert _delivered(None, key, payload).key == key


def test_a_keyless_publish_of_a_payload_naming_a_key_says_so() -> None:
    keyed = _envelope("k-1")
    assert wire_headers(None, None, keyed)[NO_KEY_HEADER]
    assert _delivered(None, None, keyed).key is None
    assert NO_KEY_HEADER not in wire_headers(None, None, _envelope(None))
    nested = _envelope(None, {"a": 1, "key": "inner"})  # a "key" member inside data
    assert _delivered(None, None, nested).key is None
    assert _delivered(None, "inner", nested).key == "inner"


def test_the_key_any_bytes_give_comes_back() -> None:
    payloads = [b"", b"raw", b',"key":"', b',"key":"a\\"b"', b'\xff,"key":"\xff"', _envelope("x")]
    for payload in payloads:
        for key in (None, "", "x", "a\\", "a", "\ufffd", 'x"'):
            assert _delivered(None, key, payload).key == key


def test_a_foreign_envelope_without_headers_gets_its_own_key() -> None:
    assert payload_key(_envelope("k-9")) == "k-9"
    assert payload_key(_envelope(None)) is None
