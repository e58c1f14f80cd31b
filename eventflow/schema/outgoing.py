"""Producer-side validation: what an app publishes must validate as its own event model.

An ``Event`` is validated when it is constructed, but ``model_construct`` and
``model_copy(update=...)`` skip validation, so an instance can carry data its consumers
would dead-letter. :func:`check_outgoing` validates the serialised payload, the exact data
consumers will validate, and raises before anything is sent. It costs one validation of the
payload, paid only for instances built without validation (``Event.model_construct`` and
``model_copy`` mark them); envelopes are published as they are (the raw path).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ..errors import EventValidationError
from ..events import Event, _summarise, is_unvalidated

__all__ = ["check_outgoing"]


def check_outgoing(message: Event, data: dict[str, Any]) -> None:
    """Raise :class:`~eventflow.errors.EventValidationError` if ``data`` fails ``message``'s model.

    ``data`` is the JSON form of ``message`` as it goes into the envelope.
    """
    if not is_unvalidated(message):
        return  # built by the constructor: pydantic validated it already
    cls = type(message)
    try:
        cls.__pydantic_validator__.validate_python(data)
    except ValidationError as exc:
        raise EventValidationError(
            f"not publishing {cls.event_type!r} v{cls.event_version}: its data does not "
            f"validate as {cls.__qualname__} ({_summarise(exc)}); it was probably built with "
            "model_construct() or model_copy(update=...), which skip validation: build it "
            "with the constructor. Nothing was sent"
        ) from exc
