"""The NATS adapter's broker headers: the envelope id travels once, as ``Nats-Msg-Id``."""

from __future__ import annotations

from eventflow.adapters.nats.delivery import MSG_ID_HEADER, NO_MESSAGE_ID, split_headers
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
