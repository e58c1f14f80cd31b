"""Context: the envelope a consumer hands over is built on first read."""

from typing import Any, cast

from eventflow import Context, Envelope
from eventflow.envelope import _wire_fields


def test_a_consumer_context_builds_its_envelope_on_first_read_only() -> None:
    env = Envelope.create("ut.ctx.lazy", {"n": 1}, key="k")
    app = cast(Any, None)
    ctx = Context._of_fields(app, _wire_fields(env.to_bytes()), None, "g", 1)
    assert ctx._envelope is None
    built = ctx.envelope
    assert built == env
    assert ctx.envelope is built


def test_a_context_given_its_envelope_returns_it() -> None:
    env = Envelope.create("ut.ctx.given", {})
    assert Context(cast(Any, None), env, "g", 2).envelope is env
    assert Context._of_fields(cast(Any, None), env.to_dict(), env, "g", 1).envelope is env
