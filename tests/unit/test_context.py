"""Context: the envelope a consumer hands over is built on first read."""

from typing import Any, cast

import pytest

from eventflow import Context, Envelope
from eventflow.envelope import _wire_fields
from eventflow.headers import COMPENSATES_HEADER


def test_a_consumer_context_builds_its_envelope_when_first_read() -> None:
    env = Envelope.create("ut.ctx.lazy", {"n": 1}, key="k")
    ctx = Context(cast(Any, None), None, "g", 1, fields=_wire_fields(env.to_bytes()))
    built = ctx.envelope
    assert built == env
    assert ctx.envelope is built


def test_a_context_needs_its_envelope_or_its_fields() -> None:
    with pytest.raises(TypeError, match="envelope or its fields"):
        Context(cast(Any, None), None, "g", 1)


def test_a_context_given_its_envelope_returns_it() -> None:
    env = Envelope.create("ut.ctx.given", {})
    ctx = Context(cast(Any, None), env, "g", 2)
    assert ctx.envelope is env
    assert (ctx.group, ctx.attempt) == ("g", 2)


class _App:
    """What ``ctx.publish`` reads of its app."""

    name = "ut-ctx"


async def test_publishing_an_envelope_honours_key_and_headers() -> None:
    handled = Envelope.create("ut.ctx.in", {}, key="in-key")
    ctx = Context(cast(Any, _App()), handled, "g", 1)
    forwarded = Envelope.create("ut.ctx.out", {"n": 1}, key="old", headers={"a": "1", "b": "2"})
    out = await ctx.publish(forwarded, key="new-key", headers={"b": "3", "c": "4"})
    assert out.key == "new-key"
    assert out.headers == {"a": "1", "b": "3", "c": "4"}  # merged over its own
    assert out.id == forwarded.id and out.data == forwarded.data  # the rest stays
    [(topic, queued)] = ctx._take_outbox()
    assert (topic, queued) == ("ut.ctx.out", out)
    same = await ctx.publish(forwarded)  # nothing given: the envelope as it is
    assert same is forwarded


async def test_a_published_event_keeps_the_handled_messages_key_unless_given() -> None:
    from eventflow import Event

    class UtCtxOut(Event, type="ut.ctx.keyed"):
        n: int

    handled = Envelope.create("ut.ctx.in", {}, key="order-1")
    ctx = Context(cast(Any, _App()), handled, "g", 1)
    assert (await ctx.publish(UtCtxOut(n=1))).key == "order-1"
    assert (await ctx.publish(UtCtxOut(n=2), key="other")).key == "other"
    keyless = Context(cast(Any, _App()), Envelope.create("ut.ctx.in", {}), "g", 1)
    assert (await keyless.publish(UtCtxOut(n=3))).key is None


def test_compensates_names_the_command_a_compensation_undoes() -> None:
    """``ctx.compensates`` is the ``eventflow-compensates`` header, from the envelope or
    from the consumer's wire fields; None for a message that is no compensation."""
    undo = Envelope.create("ut.ctx.undo", {}, headers={COMPENSATES_HEADER: "cmd-1"})
    plain = Envelope.create("ut.ctx.plain", {}, headers={"traceparent": "t"})
    assert Context(cast(Any, None), undo, "g", 1).compensates == "cmd-1"
    lazy = Context(cast(Any, None), None, "g", 1, fields=_wire_fields(undo.to_bytes()))
    assert lazy.compensates == "cmd-1"
    assert lazy._envelope is None  # read without building the envelope
    assert Context(cast(Any, None), plain, "g", 1).compensates is None
