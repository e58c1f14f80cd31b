"""Telemetry: OpenTelemetry tracing, off unless the app asks for it or a tracer provider is set.

``App(tracing=...)`` chooses:

- ``None`` (the default): on when ``opentelemetry-api`` is already imported in this process
  and a tracer provider other than the API's default is set (``trace.set_tracer_provider``,
  or the ``opentelemetry-instrument`` launcher); off otherwise. Decided when the app
  starts. Nothing of OpenTelemetry is imported to decide it: a process that never imported
  it has configured no provider.
- ``True``: on, with the global tracer provider (a provider set later is used once set);
  ``ImportError`` naming the extra when ``opentelemetry-api`` is not installed.
- ``False``: off.
- a ``TracerProvider``: on, with that provider (what tests and apps with a provider of
  their own pass; the global one can be set only once per process).

Off, the runtime holds ``None`` where a :class:`~eventflow.telemetry.tracing.Tracing` would
be and tests it with ``is not None``: no import, no call, no allocation. This module itself
imports nothing of OpenTelemetry; :mod:`eventflow.telemetry.tracing` does.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tracing import Tracing

__all__ = ["TracingSetting", "tracing_for"]

TracingSetting = Any
"""What ``App(tracing=...)`` takes: None (automatic), True, False, or a TracerProvider."""

_EXTRA = "pip install 'eventflow[otel]'"


def tracing_for(setting: TracingSetting, *, broker_url: str) -> Tracing | None:
    """The app's tracing for ``setting`` (see the module docstring), or None when off.
    ``broker_url`` names the messaging system of the spans (``nats``, ``kafka``, ``memory``)."""
    if setting is False:
        return None
    if setting is None:
        # Never imported: no provider can have been configured, and nothing is imported.
        if "opentelemetry.trace" not in sys.modules:
            return None
        from .tracing import Tracing, configured_provider

        provider = configured_provider()
        return None if provider is None else Tracing(provider, broker_url=broker_url)
    try:
        from .tracing import Tracing
    except ImportError as exc:
        raise ImportError(
            f"App(tracing=...) needs opentelemetry-api: {_EXTRA} (or pass tracing=None to "
            "trace only when it is installed and configured)"
        ) from exc
    return Tracing(None if setting is True else setting, broker_url=broker_url)
