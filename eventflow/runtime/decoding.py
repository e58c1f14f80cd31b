"""A handler's argument from a delivery's checked wire fields: its Event class, upcast and
validated (without building the Envelope in the usual case), or the Envelope itself."""

from __future__ import annotations

from typing import Any

from ..envelope import Envelope
from ..errors import UnknownEventTypeError
from ..events import EventRegistry
from ..subscribe import Signature

__all__ = ["decode_argument"]


def decode_argument(
    sig: Signature, registry: EventRegistry, handler: str, fields: dict[str, Any]
) -> tuple[Envelope | None, Any]:
    """The argument of the handler named ``handler`` (and the envelope, if decoding needed
    it): the envelope itself, or its event upcast and validated. Raises ``DecodeError``."""
    accepts = sig.accepts
    if accepts is not None:
        cls = accepts.get(fields["type"])
        if cls is not None:  # the usual case: no Envelope needed
            return None, registry.decode_data(
                fields["type"], fields["version"], fields["data"], cls
            )
    env = Envelope._trusted(fields)
    if accepts is None:
        return env, env
    if sig.any_event:
        return env, registry.decode(env)
    known = env.type in registry.types()
    raise UnknownEventTypeError(
        f"handler {handler} does not accept {env.type!r}"
        + (
            f" (it takes {', '.join(sorted(accepts))}); add it to the handler's union "
            "or narrow the pattern"
            if known
            else f": no Event class defines {env.type!r}; define it or narrow the pattern"
        )
    )
