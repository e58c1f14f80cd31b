"""What every event store does before appending: turn events into envelopes."""

from __future__ import annotations

from collections.abc import Sequence

from ..envelope import Envelope
from ..errors import ConfigurationError
from ..events import Event, to_envelope

__all__ = ["prepare_append"]


def prepare_append(stream_id: str, events: Sequence[Event | Envelope]) -> list[Envelope]:
    """Envelopes for ``events``: Event instances get new ids and the stream id as key;
    Envelopes keep theirs. A batch may not repeat an id."""
    if not stream_id:
        raise ConfigurationError("a stream id must be a non-empty string")
    if isinstance(events, (Event, Envelope)):
        raise ConfigurationError("append takes a list of events, not a single event")
    envelopes = [
        e
        if type(e) is Envelope or isinstance(e, Envelope)
        else to_envelope(e, source="", key=stream_id)
        for e in events
    ]
    if len({e.id for e in envelopes}) != len(envelopes):
        raise ConfigurationError(f"the events appended to {stream_id!r} repeat an envelope id")
    return envelopes
