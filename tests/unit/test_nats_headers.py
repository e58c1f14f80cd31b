"""The NATS adapter's broker headers: the envelope id travels once, as ``Nats-Msg-Id``."""

from __future__ import annotations

from eventflow.adapters.nats.delivery import (
    MSG_ID_HEADER,
    NO_MESSAGE_ID,
    split_headers,
    wire_headers,
)
from eventflow.headers import KEY_HEADER, MESSAGE_ID_HEADER, SEND_ID_HEADER


def test_the_envelope_id_comes_back_from_the_msg_id() -> None:
    key, headers = split_headers({MSG_ID_HEADER: "e-1", KEY_HEADER: "k", "a": "b"})
    assert key == "k"
    assert headers == {"a": "b", MESSAGE_ID_HEADER: "e-1"}


def test_a_resend_keeps_its_envelope_id_and_send_id() -> None:
    key, headers = split_headers(
        {MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1", MSG_ID_HEADER: "s-1"}
    )
    assert key is None
    assert headers == {MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1"}


def test_a_publish_without_an_envelope_id_is_delivered_without_one() -> None:
    _, headers = split_headers({MESSAGE_ID_HEADER: NO_MESSAGE_ID, MSG_ID_HEADER: "f00d", "a": "b"})
    assert headers == {"a": "b"}


def test_no_headers() -> None:
    assert split_headers(None) == (None, {})
    assert split_headers({}) == (None, {})


def test_the_headers_of_a_publish_come_back_as_they_were_published() -> None:
    for headers, key in [
        ({MESSAGE_ID_HEADER: "e-1"}, "k"),
        ({MESSAGE_ID_HEADER: "e-1", "a": "b"}, None),
        ({MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1"}, "k"),
        ({SEND_ID_HEADER: "s-1"}, "k"),  # a replay of a letter that had no envelope id
        ({"a": "b"}, "k"),
        ({}, None),
    ]:
        wire = wire_headers(headers, key)
        assert split_headers(wire) == (key, headers)


def test_the_envelope_id_goes_once_as_the_msg_id() -> None:
    assert wire_headers({MESSAGE_ID_HEADER: "e-1"}, "k") == {MSG_ID_HEADER: "e-1", KEY_HEADER: "k"}
    resend = wire_headers({MESSAGE_ID_HEADER: "e-1", SEND_ID_HEADER: "s-1"}, None)
    assert resend[MSG_ID_HEADER] == "s-1" and resend[MESSAGE_ID_HEADER] == "e-1"
    anonymous = wire_headers(None, None)
    assert anonymous[MESSAGE_ID_HEADER] == NO_MESSAGE_ID and anonymous[MSG_ID_HEADER]
