"""``peek_causation_id``: the causation id read from the wire bytes, or None when only a
decode can tell (what a reply listener relies on to skip other instances' replies)."""

from __future__ import annotations

import orjson

from eventflow.envelope import Envelope, peek_causation_id


def test_it_reads_the_causation_id_eventflow_wrote() -> None:
    env = Envelope.create(
        "shop.stock.reserved",
        {"causation_id": "not-this", "nested": {"causation_id": "nor-this"}},
        causation_id="0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        headers={"causation_id": "nor-this-either"},
    )
    assert peek_causation_id(env.to_bytes()) == "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"


def test_a_message_caused_by_nothing_has_an_empty_one() -> None:
    assert peek_causation_id(Envelope.create("t", {}).to_bytes()) == ""


def test_a_foreign_producer_s_bytes_need_a_decode() -> None:
    cause = "c-1"
    # Another key order: a nested causation_id comes first, so the bytes cannot be trusted.
    reordered = orjson.dumps(
        {"id": "x", "data": {"causation_id": "decoy"}, "type": "t", "causation_id": cause}
    )
    assert peek_causation_id(reordered) is None
    assert Envelope.from_bytes(reordered).causation_id == cause
    assert peek_causation_id(b'{ "id": "x", "type": "t", "causation_id": "c-1"}') is None
    assert peek_causation_id(b"not json") is None
    assert peek_causation_id(b'{"id":"x","type":"t"}') is None  # no such field: decode


def test_an_id_with_escapes_needs_a_decode() -> None:
    env = Envelope.create("t", {}, causation_id='odd"id\\')
    assert peek_causation_id(env.to_bytes()) is None
    assert Envelope.from_bytes(env.to_bytes()).causation_id == 'odd"id\\'


def test_a_brace_before_the_field_needs_a_decode() -> None:
    env = Envelope.create("t{x}", {}, causation_id="c-2")  # (a type no one would choose)
    assert peek_causation_id(env.to_bytes()) is None
