"""Event models, the type registry and upcasters.

An event type is a logical name plus an integer version (``type="order.placed", version=2``),
never a Python import path. Types starting with ``eventflow.`` (:data:`INTERNAL_TYPE_PREFIX`)
are eventflow's own records (a saga's transitions, ``eventflow.saga.transition``): the event
relay never publishes them, and an ``Event`` class outside eventflow may not take one.
Defining an ``Event`` subclass registers it in the default
:class:`EventRegistry`; ``@upcaster(type, from_version=N)`` registers a function that turns
version N data into version N+1 data. Decoding applies the chain up to the version the
consumer's model expects.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .envelope import Envelope, _new_root, new_id, traceparent_for
from .errors import (
    EventTypeError,
    EventValidationError,
    FutureVersionError,
    UnknownEventTypeError,
    UpcastError,
)
from .headers import TRACEPARENT_HEADER

__all__ = [
    "INTERNAL_TYPE_PREFIX",
    "Event",
    "EventRegistry",
    "Upcaster",
    "check_outgoing",
    "default_registry",
    "envelope_for",
    "is_internal_type",
    "to_envelope",
    "upcaster",
]

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

INTERNAL_TYPE_PREFIX = "eventflow."
"""The event types eventflow keeps for its own records in the store (``eventflow.saga.
transition``): they belong to eventflow's machinery, not to the services' messages, so the
event relay (``App(relay_events=True)``) skips them."""


def is_internal_type(event_type: str) -> bool:
    """True for a type of eventflow's own records (see :data:`INTERNAL_TYPE_PREFIX`)."""
    return event_type.startswith(INTERNAL_TYPE_PREFIX)


E = TypeVar("E", bound="Event")
F = TypeVar("F", bound=Upcaster)


class EventRegistry:
    """Maps (type, version) to Event classes and (type, from_version) to upcasters."""

    def __init__(self) -> None:
        self._classes: dict[str, dict[int, type[Event]]] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}

    def register(self, cls: type[Event]) -> None:
        """Register an Event class; a second class for the same type and version is an error."""
        versions = self._classes.setdefault(cls.event_type, {})
        existing = versions.get(cls.event_version)
        if existing is not None and existing is not cls:
            same_def = (existing.__module__, existing.__qualname__) == (
                cls.__module__,
                cls.__qualname__,
            )
            if not same_def:  # a module re-imported (reload, -m) redefines the same class
                raise EventTypeError(
                    f"event type {cls.event_type!r} version {cls.event_version} is already "
                    f"defined by {existing.__module__}.{existing.__qualname__}; give "
                    f"{cls.__module__}.{cls.__qualname__} another type name or a new version"
                )
        versions[cls.event_version] = cls

    def add_upcaster(self, event_type: str, from_version: int, fn: Upcaster) -> None:
        """Register ``fn`` to turn ``event_type`` data from ``from_version`` to the next one."""
        if from_version < 1:
            raise EventTypeError(f"upcaster from_version must be >= 1, got {from_version}")
        key = (event_type, from_version)
        existing = self._upcasters.get(key)
        if (
            existing is not None
            and existing is not fn
            and (
                existing.__module__,
                existing.__qualname__,
            )
            != (fn.__module__, fn.__qualname__)
        ):
            raise EventTypeError(
                f"an upcaster for {event_type!r} from version {from_version} is already "
                f"registered ({existing.__module__}.{existing.__qualname__})"
            )
        self._upcasters[key] = fn

    def get(self, event_type: str, version: int | None = None) -> type[Event]:
        """Return the class for a type at ``version`` (latest when None)."""
        versions = self._classes.get(event_type)
        if not versions:
            raise UnknownEventTypeError(
                f"unknown event type {event_type!r}: define an Event subclass with "
                f"type={event_type!r} and import it before the app starts"
            )
        if version is None:
            return versions[max(versions)]
        try:
            return versions[version]
        except KeyError:
            raise UnknownEventTypeError(
                f"event type {event_type!r} has no class for version {version} "
                f"(known: {sorted(versions)})"
            ) from None

    def is_latest(self, cls: type[Event]) -> bool:
        """True if ``cls`` is the newest class registered for its type (False when the type
        is not registered here)."""
        versions = self._classes.get(cls.event_type)
        if not versions:
            return False
        return versions[max(versions)] is cls

    def latest_version(self, event_type: str) -> int:
        """Return the newest version defined for ``event_type``."""
        return self.get(event_type).event_version

    def types(self) -> dict[str, list[int]]:
        """Return every registered type with its versions, sorted."""
        return {t: sorted(v) for t, v in sorted(self._classes.items())}

    def upcasters(self) -> dict[tuple[str, int], Upcaster]:
        """Return a copy of the registered upcasters keyed by (type, from_version)."""
        return dict(self._upcasters)

    def upcast(
        self, event_type: str, data: dict[str, Any], from_version: int, to_version: int
    ) -> dict[str, Any]:
        """Apply the upcaster chain from ``from_version`` to ``to_version``."""
        version = from_version
        while version < to_version:
            fn = self._upcasters.get((event_type, version))
            if fn is None:
                raise UpcastError(
                    f"{event_type!r} v{from_version} cannot become v{to_version}: no upcaster "
                    f"from v{version}; add @upcaster({event_type!r}, from_version={version})"
                )
            try:
                data = fn(data)
            except Exception as exc:
                raise UpcastError(
                    f"upcaster {fn.__qualname__} for {event_type!r} v{version} raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(data, dict):
                raise UpcastError(
                    f"upcaster {fn.__qualname__} for {event_type!r} v{version} returned "
                    f"{type(data).__name__}, not a dict"
                )
            version += 1
        return data

    def decode_as(self, envelope: Envelope, cls: type[E]) -> E:
        """Turn an envelope into an instance of ``cls``: upcast, then validate.

        Raises a :class:`~eventflow.errors.DecodeError` subclass naming the problem.
        """
        if envelope.version != cls.event_version:
            return self.decode_data(envelope.type, envelope.version, envelope.data, cls)
        # The common case (stored at the code's version: nothing to upcast) in this frame:
        # replays and projections decode every event here, and a call less is a tenth of
        # the decoding.
        try:
            return cls.__pydantic_validator__.validate_python(envelope.data)  # type: ignore[no-any-return]
        except ValidationError as exc:
            raise _invalid(envelope.type, envelope.version, cls, exc) from exc

    def decode_data(self, event_type: str, version: int, data: dict[str, Any], cls: type[E]) -> E:
        """:meth:`decode_as` for an envelope's type, version and data: upcast ``data`` from
        ``version`` to ``cls``'s, then validate it as ``cls``."""
        target = cls.event_version
        if version > target:
            raise FutureVersionError(
                f"{event_type!r} v{version} is newer than the code's v{target}: "
                "deploy the consumer with the new event version"
            )
        if version < target:
            data = self.upcast(event_type, data, version, target)
        try:
            return cls.__pydantic_validator__.validate_python(data)  # type: ignore[no-any-return]
        except ValidationError as exc:
            raise _invalid(event_type, version, cls, exc) from exc

    def decode(self, envelope: Envelope) -> Event:
        """Decode an envelope into the latest class registered for its type."""
        versions = self._classes.get(envelope.type)
        if not versions:
            raise UnknownEventTypeError(
                f"unknown event type {envelope.type!r} v{envelope.version}: no Event "
                "class defines it"
            )
        return self.decode_as(envelope, versions[max(versions)])


def _invalid(
    event_type: str, version: int, cls: type[Event], exc: ValidationError
) -> EventValidationError:
    """The error for ``event_type`` v``version`` data that ``cls`` does not validate."""
    return EventValidationError(
        f"{event_type!r} v{version} data does not validate as {cls.__qualname__}: {_summarise(exc)}"
    )


def _summarise(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


default_registry = EventRegistry()


class Event(BaseModel):
    """Base class of event models: a pydantic v2 model with a type name and a version.

    ``class OrderPlaced(Event, type="order.placed", version=2): ...``. Instances are frozen.
    """

    model_config = ConfigDict(frozen=True)

    event_type: ClassVar[str] = ""
    event_version: ClassVar[int] = 1
    event_compatibility: ClassVar[str] = "backward"
    """Schema compatibility mode checked by ``eventflow schema check``: ``backward``
    (default), ``forward``, ``full`` or ``none``; set with ``compatibility=...``."""

    def __init_subclass__(
        cls,
        *,
        type: str | None = None,
        version: int | None = None,
        compatibility: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if compatibility is not None:
            if compatibility not in ("backward", "forward", "full", "none"):
                raise EventTypeError(
                    f"{cls.__qualname__}: compatibility must be 'backward', 'forward', "
                    f"'full' or 'none', got {compatibility!r}"
                )
            cls.event_compatibility = compatibility
        if type is None:
            if version is not None:
                raise EventTypeError(f"{cls.__qualname__}: version= given without type=")
            return  # an abstract intermediate base: not registered
        if not type or any(part == "" for part in type.split(".")):
            raise EventTypeError(
                f"{cls.__qualname__}: type {type!r} must be dot-separated non-empty tokens"
            )
        if any(ch in type for ch in "*> \t"):
            raise EventTypeError(
                f"{cls.__qualname__}: type {type!r} may not contain wildcards or spaces"
            )
        if is_internal_type(type) and not cls.__module__.startswith("eventflow."):
            raise EventTypeError(
                f"{cls.__qualname__}: type {type!r} starts with {INTERNAL_TYPE_PREFIX!r}, "
                "which eventflow keeps for its own records (the event relay never publishes "
                "them): name it after your domain, e.g. 'orders.placed'"
            )
        v = 1 if version is None else version
        if not isinstance(v, int) or v < 1:
            raise EventTypeError(f"{cls.__qualname__}: version must be an int >= 1, got {v!r}")
        cls.event_type = type
        cls.event_version = v

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        # Runs once pydantic has built the model, so the class is complete when registered.
        super().__pydantic_init_subclass__(**kwargs)
        if cls.event_type and "event_type" in cls.__dict__:
            default_registry.register(cls)

    @classmethod  # type: ignore[no-redef]  # the pydantic mypy plugin declares it too
    def model_construct(  # type: ignore[override]
        cls, _fields_set: set[str] | None = None, **values: Any
    ) -> Self:
        """pydantic's ``model_construct`` (no validation); the instance is validated when it
        is published instead."""
        instance = super().model_construct(_fields_set, **values)
        _mark_unvalidated(instance)
        return instance

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """pydantic's ``model_copy``; a copy with ``update`` (not validated) is validated when
        it is published."""
        # pydantic copies through __copy__/__deepcopy__, which carry an existing mark.
        copied = super().model_copy(update=update, deep=deep)
        if update:
            _mark_unvalidated(copied)
        return copied

    # Copies and pickles of an unvalidated instance stay unvalidated (also in another
    # process: the mark travels in the pickled state).
    def __copy__(self) -> Self:
        return _carry_mark(self, super().__copy__())

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        return _carry_mark(self, super().__deepcopy__(memo))

    def __getstate__(self) -> dict[Any, Any]:
        state = super().__getstate__()
        if is_unvalidated(self):
            state = {**state, _UNVALIDATED_STATE: True}
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        unvalidated = _UNVALIDATED_STATE in state
        if unvalidated:
            state = {k: v for k, v in state.items() if k != _UNVALIDATED_STATE}
        super().__setstate__(state)
        if unvalidated:
            _mark_unvalidated(self)


# Event instances built without validation (``model_construct``, ``model_copy(update=)``),
# by identity (an event with a list field is unhashable, and an equal validated event is not
# the same instance): publishing validates these, and only these, before sending.
_UNVALIDATED: dict[int, weakref.ReferenceType[Event]] = {}
_UNVALIDATED_STATE = "__eventflow_unvalidated__"


def is_unvalidated(instance: Event) -> bool:
    """True if ``instance`` was built without validation (and not validated since)."""
    if not _UNVALIDATED:
        return False
    ref = _UNVALIDATED.get(id(instance))
    return ref is not None and ref() is instance


def check_outgoing(message: Event, data: dict[str, Any]) -> None:
    """Raise :class:`~eventflow.errors.EventValidationError` if ``data`` fails ``message``'s model.

    ``data`` is the JSON form of ``message`` as it goes into the envelope. Only an instance
    built without validation (``model_construct``, ``model_copy(update=...)``) is checked:
    the constructor validated every other one. Every envelope made from an event (published,
    sent from a handler, appended to a store) is checked here, by :func:`envelope_for`.
    """
    if not is_unvalidated(message):
        return
    cls = type(message)
    try:
        cls.__pydantic_validator__.validate_python(data)
    except ValidationError as exc:
        raise EventValidationError(
            f"refusing {cls.event_type!r} v{cls.event_version}: its data does not validate "
            f"as {cls.__qualname__} ({_summarise(exc)}); it was probably built with "
            "model_construct() or model_copy(update=...), which skip validation: build it "
            "with the constructor. Nothing was published or appended"
        ) from exc


def _carry_mark(source: Event, copied: E) -> E:
    """``copied``, marked unvalidated if ``source`` is."""
    if is_unvalidated(source):
        _mark_unvalidated(copied)
    return copied


def _mark_unvalidated(instance: Event) -> None:
    key = id(instance)

    def forget(ref: weakref.ReferenceType[Event]) -> None:
        if _UNVALIDATED.get(key) is ref:  # not a newer instance's entry under a reused id
            del _UNVALIDATED[key]

    _UNVALIDATED[key] = weakref.ref(instance, forget)


def upcaster(
    event_type: str, *, from_version: int, registry: EventRegistry | None = None
) -> Callable[[F], F]:
    """Register a function turning ``event_type`` data of ``from_version`` into the next version.

    Chains are applied in order (v1 -> v2 -> v3) when a consumer expects a newer version.
    The function goes into ``registry`` (the default registry when None): only an app,
    repository or projection runner decoding with that registry applies it.
    """
    target = default_registry if registry is None else registry

    def mark(fn: F) -> F:
        target.add_upcaster(event_type, from_version, fn)
        return fn

    return mark


def to_envelope(
    message: Event | Envelope,
    *,
    source: str,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    parent_traceparent: str | None = None,
    id: str | None = None,
) -> Envelope:
    """Wrap an event in a new envelope (see :func:`envelope_for`); an Envelope passes
    through unchanged."""
    if isinstance(message, Event):
        return envelope_for(
            message,
            source=source,
            key=key,
            headers=headers,
            correlation_id=correlation_id,
            causation_id=causation_id,
            parent_traceparent=parent_traceparent,
            id=id,
        )
    if isinstance(message, Envelope):
        return message
    raise _not_an_event(message)


def envelope_for(
    event: Event,
    *,
    source: str,
    key: str | None = None,
    headers: Mapping[str, str] | None = None,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    parent_traceparent: str | None = None,
    id: str | None = None,
) -> Envelope:
    """A new envelope around ``event`` (an instance of an Event subclass declared with
    ``type=``).

    The envelope gets a new UUIDv7 id unless ``id`` is given, and starts a correlation of
    its own (its id) unless ``correlation_id`` is given. The headers get a ``traceparent``
    unless they carry one: a child of ``parent_traceparent`` when given, else the root of a
    trace named after the correlation. The data is the event's JSON form; an event built
    without validation has it checked first (:func:`check_outgoing`).
    """
    if not event.event_type:
        raise _not_an_event(event)
    hdrs = dict(headers) if headers else {}
    if id is None and correlation_id is None and parent_traceparent is None:
        # A message that starts a correlation (App.publish's usual case): its id, the root
        # of its trace and its time (the millisecond the id carries, from a clock that
        # never runs backwards) come from one call, a third of the cost of making them apart.
        env_id, root, stamp = _new_root()
        hdrs.setdefault(TRACEPARENT_HEADER, root)
        correlation = env_id
    else:
        stamp = datetime.now(UTC)
        env_id = id or new_id()
        correlation = correlation_id or env_id
        if TRACEPARENT_HEADER not in hdrs:
            hdrs[TRACEPARENT_HEADER] = traceparent_for(env_id, correlation, parent_traceparent)
    data = event.__pydantic_serializer__.to_python(event, mode="json", warnings=False)
    check_outgoing(event, data)
    # Every value here is valid by construction (the data just checked), so the envelope
    # skips validation.
    return Envelope._trusted(
        {
            "id": env_id,
            "type": event.event_type,
            "version": event.event_version,
            "source": source,
            "time": stamp,
            "correlation_id": correlation,
            "causation_id": causation_id,
            "key": key,
            "headers": hdrs,
            "data": data,
        }
    )


def _not_an_event(message: object) -> EventTypeError:
    return EventTypeError(
        f"cannot publish {message!r}: pass an instance of an Event subclass declared "
        "with type=... (or an Envelope)"
    )
