"""Producer-side validation: what an app publishes must validate as its own event model.

An ``Event`` is validated when it is constructed, but ``model_construct`` and
``model_copy(update=...)`` skip validation, so an instance can carry data its consumers
would dead-letter. :func:`check_outgoing` validates the serialised payload, the exact data
consumers will validate, and raises before anything is sent. It costs one validation of the
payload, paid only for instances built without validation (``Event.model_construct`` and
``model_copy`` mark them); envelopes are published as they are (the raw path). It lives in
:mod:`eventflow.events`, where :func:`~eventflow.events.envelope_for` calls it for every
envelope it makes; this module keeps its public name.
"""

from __future__ import annotations

from ..events import check_outgoing

__all__ = ["check_outgoing"]
