"""From an input's outcome to the envelopes it sends: a pure function, beside the machine.

Each command keeps the id the machine gave it (the same on every re-run of the input, so a
deduplicating participant handles it once); a plain message from a timer method gets an
id numbered within its input (after its commands). Every envelope carries the saga's key
(its inputs share it, so they are handled one at a time per saga), continues the cause's
correlation and trace, and a compensation names the command it undoes in
``eventflow-compensates`` (DESIGN 5: a participant's group that has not handled that
command yet cancels it instead).

The runtime's handlers, the timer loop, ``app.sagas`` (a person's retry, skip and abort),
the command line and the test kit all send what :func:`envelopes` gives.
"""

from __future__ import annotations

from ..envelope import Envelope, hashed_id
from ..events import Event, envelope_for
from ..headers import COMPENSATES_HEADER, TRACEPARENT_HEADER
from .control import Control
from .definition import SagaDefinition
from .machine import Outcome

__all__ = ["envelopes"]


def envelopes(
    definition: SagaDefinition,
    control: Control,
    outcome: Outcome,
    cause: Envelope | None,
    *,
    source: str,
) -> list[tuple[str, Envelope]]:
    """The (topic, envelope) pairs of an input's commands, then its plain messages.
    ``cause``: the message applied (None for a timer or a person's action)."""
    correlation = cause.correlation_id if cause is not None else control.correlation_id
    parent = cause.headers.get(TRACEPARENT_HEADER) if cause is not None else None
    causation = cause.id if cause is not None else None
    out: list[tuple[str, Envelope]] = []

    def add(event: Event, message_id: str, headers: dict[str, str] | None) -> None:
        env = envelope_for(
            event,
            source=source,
            key=control.key,
            headers=headers,
            correlation_id=correlation,
            causation_id=causation,
            parent_traceparent=parent,
            id=message_id,
        )
        out.append((env.type, env))

    for command in outcome.commands:
        undoes = command.compensates
        add(command.event, command.id, {COMPENSATES_HEADER: undoes} if undoes else None)
    for n, message in enumerate(outcome.messages, len(outcome.commands)):
        message_id = hashed_id(
            control.origin_ms, definition.name, control.key, str(control.seq), str(n)
        )
        add(message, message_id, None)
    return out
