"""``Aggregate``: a consistency boundary whose state is rebuilt from its event stream.

An aggregate is a pydantic v2 model (not frozen, assignments not re-validated) whose
annotated fields with defaults are its state, plus ``id`` and ``version``::

    class Order(Aggregate, stream="order"):
        status: str = "new"
        lines: list[Line] = []          # pydantic copies mutable defaults per instance

        def place(self, sku: str) -> None:              # a command: check, then record
            if self.status != "new":
                raise ValueError("already placed")
            self.record(OrderPlaced(order_id=self.id, sku=sku, qty=1))

        @on(OrderPlaced)                                # an applier: only mutates state
        def _placed(self, e: OrderPlaced) -> None:
            self.status = "placed"

Why a pydantic model: mutable defaults are copied per instance, and a snapshot is simply
``model_dump(mode="json")`` / ``model_validate`` of the same fields, so a snapshot restores
exactly the state a full replay gives (datetimes, nested models, sets, decimals, ...).
The events not yet saved live in a private attribute, outside the state.

Class keywords: ``stream=`` names the stream prefix (default: the class name in
snake_case; it is persisted, so set it explicitly before renaming a class),
``snapshot_version=`` (bump it when appliers change the meaning of state, so old
snapshots are ignored) and ``ignore_unknown_events=True`` (skip stream events that have
no ``@on`` method instead of failing).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr

from ..errors import ConfigurationError, StoreError, UnknownEventTypeError
from ..events import Event, EventRegistry
from ..ports import RecordedEvent
from .on import appliers

__all__ = ["Aggregate", "stream_name"]

_Applier = tuple[type[Event], Callable[[Any, Any], Any]]
_STREAM_RE = re.compile(r"^[A-Za-z0-9_.:]+$")


def stream_name(cls_name: str) -> str:
    """The default stream prefix of an aggregate class: its name in snake_case
    (``ShoppingCart`` -> ``shopping_cart``)."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls_name).lower()


class Aggregate(BaseModel):
    """Base class of event-sourced aggregates: state fields, ``@on`` appliers, ``record()``.

    ``Order(id="o-2")`` is a new aggregate at version 0. ``record(event)`` applies an event
    at once (through its ``@on`` method) and queues it for ``Repository.save``; ``version``
    counts the events applied, the queued ones included. Appliers must be plain (not
    async) methods that only change state: they run again on every load.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    id: str
    """The aggregate's id; its stream is ``f"{stream}-{id}"``."""
    version: int = 0
    """How many events this aggregate has applied (0 for a new one), queued ones included."""

    aggregate_stream: ClassVar[str] = "aggregate"
    """The stream prefix (class keyword ``stream=``)."""
    snapshot_version: ClassVar[int] = 1
    """Bumped by hand when old snapshots must be ignored (class keyword)."""
    ignore_unknown_events: ClassVar[bool] = False
    """Skip stream events without an ``@on`` method instead of raising (class keyword)."""
    aggregate_appliers: ClassVar[dict[str, _Applier]] = {}
    """Event type -> (event class, applier function), collected from ``@on`` methods."""

    # A default (pydantic copies it per instance), not ``default_factory=list``: pydantic
    # inspects a factory's signature at every construction (about 0.3 ms for a builtin).
    _pending: list[Event] = PrivateAttr(default=[])

    def __init_subclass__(
        cls,
        *,
        stream: str | None = None,
        snapshot_version: int | None = None,
        ignore_unknown_events: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        prefix = stream_name(cls.__name__) if stream is None else stream
        if not prefix or not _STREAM_RE.match(prefix):
            raise ConfigurationError(
                f"{cls.__qualname__}: stream {prefix!r} must be non-empty letters, digits, "
                "'_', '.' or ':' (no '-', which separates the prefix from the id)"
            )
        cls.aggregate_stream = prefix
        if snapshot_version is not None:
            if not isinstance(snapshot_version, int) or snapshot_version < 1:
                raise ConfigurationError(
                    f"{cls.__qualname__}: snapshot_version must be an int >= 1, "
                    f"got {snapshot_version!r}"
                )
            cls.snapshot_version = snapshot_version
        if ignore_unknown_events is not None:
            cls.ignore_unknown_events = bool(ignore_unknown_events)
        cls.aggregate_appliers = _collect(cls)

    @property
    def pending(self) -> tuple[Event, ...]:
        """The events recorded since the aggregate was loaded or last saved, oldest first."""
        return tuple(self._pending)

    @property
    def saved_version(self) -> int:
        """The stream version this aggregate was loaded at (or last saved at); 0 if new."""
        return self.version - len(self._pending)

    def record(self, event: Event) -> None:
        """Apply ``event`` now and queue it for the next ``Repository.save``.

        Raises ``UnknownEventTypeError`` if the aggregate has no ``@on`` method for it
        (unless the class sets ``ignore_unknown_events=True``: then it is only queued).
        If the applier raises, nothing is queued and ``version`` does not change.
        """
        if not isinstance(event, Event) or not event.event_type:
            raise ConfigurationError(
                f"record() takes an instance of an Event subclass declared with type=..., "
                f"got {event!r}"
            )
        entry = self.aggregate_appliers.get(event.event_type)
        if entry is not None:
            entry[1](self, event)
        elif not self.ignore_unknown_events:
            raise self._no_applier(event.event_type, "record")
        self._pending.append(event)
        self.version += 1

    def _replay(self, rec: RecordedEvent, registry: EventRegistry) -> None:
        """Apply one stored event (loading), decoded (and upcast) by ``registry``; the
        stream version must follow ours."""
        if rec.stream_version != self.version + 1:
            raise StoreError(
                f"stream {rec.stream_id!r} gave version {rec.stream_version} after "
                f"{self.version}: the store returned a gap or a repeat; check the store"
            )
        env = rec.envelope
        entry = self.aggregate_appliers.get(env.type)
        if entry is not None:
            event_cls, fn = entry
            if rec.registry is registry and registry.is_latest(event_cls):
                event = rec.event  # decoded once and cached on the record
            else:  # another registry, or an applier written for an older class of the type
                event = registry.decode_as(env, event_cls)
            fn(self, event)
        elif not self.ignore_unknown_events:
            raise self._no_applier(env.type, f"stream {rec.stream_id!r} v{rec.stream_version}")
        self.version = rec.stream_version

    def _saved(self, version: int) -> None:
        """Forget the pending events: the store now holds them, the stream is at ``version``."""
        self._pending.clear()
        self.version = version

    def _no_applier(self, event_type: str, where: str) -> UnknownEventTypeError:
        name = type(self).__qualname__
        return UnknownEventTypeError(
            f"{name} has no @on method for event type {event_type!r} ({where}): add one, "
            f"or declare class {name}(Aggregate, ignore_unknown_events=True) to skip such events"
        )


def _collect(cls: type[Aggregate]) -> dict[str, _Applier]:
    found: dict[str, _Applier] = {}
    for event_type, (event_cls, name) in appliers(cls).items():
        fn = inspect.getattr_static(cls, name)
        if isinstance(fn, staticmethod | classmethod) or not callable(fn):
            raise ConfigurationError(
                f"{cls.__qualname__}.{name}: @on appliers of an aggregate must be plain "
                "methods (self, event)"
            )
        if inspect.iscoroutinefunction(fn):
            raise ConfigurationError(
                f"{cls.__qualname__}.{name}: aggregate appliers must be plain `def`, not "
                "`async def`: they only change state and run on every load"
            )
        found[event_type] = (event_cls, fn)
    return found
