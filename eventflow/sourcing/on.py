"""``@on(EventClass, ...)``: marks an aggregate or projection method as the applier of events.

The decorator only marks the function; ``Aggregate`` and ``Projection`` subclasses collect
their marked methods in ``__init_subclass__`` (see ``appliers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ConfigurationError
from ..events import Event

__all__ = ["appliers", "on"]

_MARK = "__eventflow_on__"
F = TypeVar("F", bound=Callable[..., Any])


def on(*event_types: type[Event]) -> Callable[[F], F]:
    """Mark a method as the applier of ``event_types`` (Event subclasses with a type)."""
    if not event_types:
        raise ConfigurationError("@on needs at least one Event class: @on(OrderPlaced)")
    for cls in event_types:
        if not (isinstance(cls, type) and issubclass(cls, Event) and cls.event_type):
            raise ConfigurationError(
                f"@on takes Event subclasses declared with type=..., got {cls!r}"
            )

    def mark(fn: F) -> F:
        setattr(fn, _MARK, (*getattr(fn, _MARK, ()), *event_types))
        return fn

    return mark


def appliers(cls: type) -> dict[str, tuple[type[Event], str]]:
    """Event type -> (event class, method name) of the ``@on`` methods of ``cls`` and its bases.

    A subclass's method for a type replaces its base's; two methods of one class for the
    same type are an error.
    """
    found: dict[str, tuple[type[Event], str]] = {}
    for klass in reversed(cls.__mro__):
        own: dict[str, str] = {}
        for name, member in vars(klass).items():
            for event_cls in getattr(member, _MARK, ()):
                if event_cls.event_type in own:
                    raise ConfigurationError(
                        f"{klass.__qualname__} has two @on methods for "
                        f"{event_cls.event_type!r}: {own[event_cls.event_type]} and {name}"
                    )
                own[event_cls.event_type] = name
                found[event_cls.event_type] = (event_cls, name)
    return found
