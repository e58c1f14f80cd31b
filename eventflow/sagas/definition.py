"""Declaring a saga: the ``Saga`` base class, ``@step`` and its compensation, named timers.

A saga class is a pydantic model (its fields are the saga's state) declared with a name,
the event that starts it and the field of that event naming its key::

    class OrderSaga(Saga, name="order", start=OrderPlaced, key="order_id", abort=OrderCancelled):
        order_id: str = ""

        def started(self, e: OrderPlaced) -> None: ...

        @step(reply=StockReserved, reject=StockRejected, timeout=30.0)
        def reserve(self) -> Event: ...

        @reserve.compensate
        def release(self) -> Event: ...

Everything here is definition only: :mod:`eventflow.sagas.machine` runs it.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from pydantic import BaseModel, ConfigDict

from ..errors import ConfigurationError
from ..events import Event
from ..runtime.retry import RetryPolicy
from .slots import PrivateSlot

__all__ = [
    "Abort",
    "CancelTimer",
    "Compensation",
    "Effect",
    "Saga",
    "SagaDefinition",
    "SetTimer",
    "Step",
    "on_timer",
    "step",
]

StepFn = Callable[..., Any]
_NAME = re.compile(r"^[a-z][a-z0-9_.]*$")
_RESERVED_TIMERS = ("step:", "retry:")  # the machine's own timers: a step's deadline, a backoff
# The class keywords' defaults: sagas handled at once per process, attempts in all at
# handling one message, seconds one handling may take.
DEFAULT_CONCURRENCY, DEFAULT_RETRY, DEFAULT_TIMEOUT = 8, 5, 30.0


@dataclass(frozen=True)
class SetTimer:
    """A saga method asked for the named timer to fire in ``seconds``."""

    name: str
    seconds: float


@dataclass(frozen=True)
class CancelTimer:
    """A saga method asked for the named timer to be cancelled."""

    name: str


@dataclass(frozen=True)
class Abort:
    """A saga method asked for the saga to stop going forward and compensate."""

    reason: str


Effect = SetTimer | CancelTimer | Abort
"""What a saga method asks of the machine; applied once the method has returned."""


def _event_types(value: object, what: str) -> tuple[type[Event], ...]:
    """``value`` (None, an Event class, a union or a tuple of them) as a tuple of classes."""
    if value is None:
        return ()
    if typing.get_origin(value) in (Union, types.UnionType):
        items: tuple[object, ...] = typing.get_args(value)
    elif isinstance(value, tuple):
        items = value
    else:
        items = (value,)
    for item in items:
        if not (isinstance(item, type) and issubclass(item, Event) and item.event_type):
            raise ConfigurationError(
                f"{what} takes Event classes declared with type=... (or a union of them), "
                f"got {item!r}"
            )
    return tuple(items)  # type: ignore[arg-type]


@dataclass(eq=False)
class Compensation:
    """The command that undoes a step, and whether to wait for its reply."""

    fn: StepFn
    reply: tuple[type[Event], ...] = ()
    timeout: float | None = None

    @property
    def name(self) -> str:
        """The method's name."""
        return self.fn.__name__


@dataclass(eq=False)
class Step:
    """One ``@step``: the method making its command and what answers it.

    Its ``compensate`` and ``on_reply`` decorate the step's compensation
    (``@reserve.compensate``) and reply handler (``@charge.on_reply``), which stay plain
    methods of the class.
    """

    fn: StepFn
    reply: tuple[type[Event], ...] = ()
    reject: tuple[type[Event], ...] = ()
    timeout: float | None = None
    pivot: bool = False
    retry: int = 5
    retry_delay: float = 1.0
    compensation: Compensation | None = None
    reply_handler: StepFn | None = None
    name: str = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def compensate(
        self,
        fn: StepFn | None = None,
        *,
        reply: object = None,
        timeout: float | None = None,
    ) -> Any:
        """Declare the step's compensation: ``@step_name.compensate`` (counted done once
        issued) or ``@step_name.compensate(reply=Undone, timeout=30.0)`` (waited for: no
        reply in time leaves the saga ``failed``)."""
        replies = _event_types(reply, f"{self.fn.__name__}.compensate(reply=)")
        if replies and timeout is None:
            raise ConfigurationError(
                f"{self.fn.__name__}.compensate(reply=...) needs a timeout=: a compensation "
                "waited for without one could wait forever"
            )
        if timeout is not None and not replies:
            raise ConfigurationError(
                f"{self.fn.__name__}.compensate(timeout=...) needs reply=: a plain "
                "compensation is done once issued, so nothing would be timed"
            )
        if timeout is not None and timeout <= 0:
            raise ConfigurationError(
                f"{self.fn.__name__}.compensate(timeout={timeout!r}) must be positive seconds"
            )

        def mark(method: StepFn) -> StepFn:
            if self.compensation is not None:
                raise ConfigurationError(f"step {self.fn.__name__} has two compensations")
            self.compensation = Compensation(method, replies, timeout)
            return method

        return mark(fn) if fn is not None else mark

    def on_reply(self, fn: StepFn) -> StepFn:
        """Declare the method called with the step's reply (to keep what later steps need)."""
        if not self.reply:
            raise ConfigurationError(f"step {self.fn.__name__} has no reply= to handle")
        if self.reply_handler is not None:
            raise ConfigurationError(f"step {self.fn.__name__} has two on_reply methods")
        self.reply_handler = fn
        return fn


def step(
    *,
    reply: object = None,
    reject: object = None,
    timeout: float | None = None,
    pivot: bool = False,
    retry: int = 5,
    retry_delay: float = 1.0,
) -> Callable[[StepFn], Step]:
    """Mark a saga method as a step: it returns the command to send (or None: a local step
    that succeeds at once), sync or async.

    - ``reply``: the event (a class or a union) that tells the step succeeded.
    - ``reject``: the event(s) that tell it failed: earlier steps are compensated.
    - ``timeout``: seconds to wait for either; past it the step failed (and is compensated
      with the others, as its command may have taken effect).
    - ``pivot``: the go/no-go step; steps after it only go forward: one rejected or timed
      out is sent again (a new command id per attempt, ``retry_delay`` seconds apart,
      doubling) up to ``retry`` attempts in all, then the saga is ``failed``.
    """
    replies = _event_types(reply, "step(reply=)")
    rejects = _event_types(reject, "step(reject=)")
    if timeout is not None and timeout <= 0:
        raise ConfigurationError(f"step(timeout={timeout!r}) must be positive seconds")
    if (rejects or timeout is not None) and not replies:
        raise ConfigurationError("a step with reject= or timeout= needs reply=: what succeeds it?")
    if retry < 1:
        raise ConfigurationError(f"step(retry={retry!r}) counts attempts in all: at least 1")
    if retry_delay < 0:
        raise ConfigurationError(f"step(retry_delay={retry_delay!r}) must be seconds >= 0")

    def mark(fn: StepFn) -> Step:
        return Step(fn, replies, rejects, timeout, pivot, retry, retry_delay)

    return mark


def on_timer(name: str) -> Callable[[StepFn], StepFn]:
    """Mark a saga method called when the named timer set with ``self.set_timer(name, s)``
    fires. It may set or cancel timers, call ``self.abort(reason)``, or return an event to
    publish (with the saga's key)."""
    if not name or name.startswith(_RESERVED_TIMERS):
        raise ConfigurationError(
            f"a timer name must be non-empty and not start with 'step:' or 'retry:' (the "
            f"machine's deadlines and backoffs), got {name!r}"
        )

    def mark(fn: StepFn) -> StepFn:
        fn.__eventflow_timer__ = name  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass(frozen=True)
class SagaDefinition:
    """What a saga class declares, checked at class creation."""

    name: str
    start: type[Event]
    key: str
    steps: tuple[Step, ...]
    abort: tuple[type[Event], ...]
    timers: dict[str, str] = field(default_factory=dict)  # timer name -> method name
    concurrency: int = DEFAULT_CONCURRENCY
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy.of(DEFAULT_RETRY))
    timeout: float | None = DEFAULT_TIMEOUT

    @property
    def stream_prefix(self) -> str:
        """``saga-<name>-``: the saga's stream is this and its key."""
        return f"saga-{self.name}-"

    @property
    def group(self) -> str:
        """``saga.<name>``: the consumer group of the saga's handlers."""
        return f"saga.{self.name}"

    def step(self, name: str) -> Step:
        """The step called ``name``; raises ``KeyError``."""
        found = self.find(name)
        if found is None:
            raise KeyError(name)
        return found

    def find(self, name: str) -> Step | None:
        """The step called ``name``, or None (a deploy removed it)."""
        return next((s for s in self.steps if s.name == name), None)

    def after(self, name: str | None, done: typing.Collection[str]) -> Step | None:
        """The step to run after the step ``name`` (None: before the first): the first
        step after it in this definition that is not in ``done``; None past the last.
        Raises ``KeyError`` when ``name`` is not a step of this definition."""
        if name is None:
            start = 0
        else:
            found = self.find(name)
            if found is None:
                raise KeyError(name)
            start = self.steps.index(found) + 1
        return next((s for s in self.steps[start:] if s.name not in done), None)

    def is_abort(self, event: Event) -> bool:
        """True if ``event`` is one of the saga's abort events."""
        return any(event.event_type == cls.event_type for cls in self.abort)

    def input_types(self) -> tuple[type[Event], ...]:
        """Every event type the saga handles: its start, replies, rejects and abort."""
        seen: dict[str, type[Event]] = {self.start.event_type: self.start}
        for s in self.steps:
            for cls in (*s.reply, *s.reject, *(s.compensation.reply if s.compensation else ())):
                seen.setdefault(cls.event_type, cls)
        for cls in self.abort:
            seen.setdefault(cls.event_type, cls)
        return tuple(seen.values())


class Saga(BaseModel):
    """Base class of sagas: subclass with ``name=``, ``start=``, ``key=`` (and ``abort=``).

    The subclass's fields are the saga's state (give each a default); it is saved after
    every transition. A loaded saga (``app.sagas.get``) also has ``id``, ``key``,
    ``status`` and ``history``.
    """

    model_config = ConfigDict(extra="forbid", ignored_types=(Step, PrivateSlot))

    definition: ClassVar[SagaDefinition]

    # Not PrivateAttr, whose defaults pydantic copies at every validation (see slots.py).
    _meta = PrivateSlot[dict[str, Any]](dict)
    _effects = PrivateSlot[list[Effect]](list)

    def __init_subclass__(
        cls,
        *,
        name: str | None = None,
        start: type[Event] | None = None,
        key: str | None = None,
        abort: object = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        retry: int | RetryPolicy | None = DEFAULT_RETRY,
        timeout: float | None = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            return  # an intermediate base class
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ConfigurationError(
                f"saga {name!r}: concurrency={concurrency!r} counts sagas handled at once: "
                "an int >= 1"
            )
        if timeout is not None and not timeout > 0:
            raise ConfigurationError(
                f"saga {name!r}: timeout={timeout!r} is the seconds one handling may take: "
                "> 0, or None for no limit"
            )
        policy = RetryPolicy.of(retry)
        if not _NAME.match(name):
            raise ConfigurationError(
                f"saga name {name!r}: use lowercase letters, digits, '_' and '.' (it names "
                "streams and CLI ids)"
            )
        if not (isinstance(start, type) and issubclass(start, Event) and start.event_type):
            raise ConfigurationError(f"saga {name!r} needs start=<an Event class>, got {start!r}")
        if not key or key not in start.model_fields:
            raise ConfigurationError(
                f"saga {name!r}: key={key!r} must name a field of {start.__name__} (the "
                "saga's key, also the key of its messages)"
            )
        steps = tuple(v for v in vars(cls).values() if isinstance(v, Step))
        timers: dict[str, str] = {}
        for attr, v in vars(cls).items():
            if callable(v) and hasattr(v, "__eventflow_timer__"):
                timer = v.__eventflow_timer__
                if timer in timers:
                    raise ConfigurationError(
                        f"saga {name!r} has two @on_timer({timer!r}) methods: "
                        f"{timers[timer]} and {attr}"
                    )
                timers[timer] = attr
        pivots = [s.name for s in steps if s.pivot]
        if len(pivots) > 1:
            raise ConfigurationError(f"saga {name!r} has two pivot steps: {pivots}")
        after_pivot = False
        for s in steps:
            if after_pivot and s.compensation is not None:
                raise ConfigurationError(
                    f"saga {name!r}: step {s.name} comes after the pivot, so it is never "
                    "compensated; remove its compensation"
                )
            after_pivot = after_pivot or s.pivot
        cls.definition = SagaDefinition(
            name,
            start,
            key,
            steps,
            _event_types(abort, "abort="),
            timers,
            concurrency,
            policy,
            None if timeout is None else float(timeout),
        )

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a state field without a default: a saga is made before its start event
        is applied (and for inputs kept before its start), with every field at its default."""
        super().__pydantic_init_subclass__(**kwargs)
        if "definition" not in vars(cls):
            return
        required = [n for n, f in cls.model_fields.items() if f.is_required()]
        if required:
            fields = ", ".join(required)
            raise ConfigurationError(
                f"saga {cls.definition.name!r}: field(s) {fields} of {cls.__name__} have no "
                'default; give each one (e.g. `order_id: str = ""`) and set it in '
                "started() from the start event"
            )

    # -- what steps and handlers may call ----------------------------------------------------

    def set_timer(self, name: str, seconds: float) -> None:
        """Set (or reschedule) the named timer to fire in ``seconds``; its ``@on_timer``
        method runs then. Takes effect with the transition that calls it."""
        if name not in type(self).definition.timers:
            raise ConfigurationError(f"no @on_timer({name!r}) method on {type(self).__name__}")
        self._effects.append(SetTimer(name, float(seconds)))

    def cancel_timer(self, name: str) -> None:
        """Cancel the named timer (nothing happens if it is not set)."""
        if name not in type(self).definition.timers:
            raise ConfigurationError(f"no @on_timer({name!r}) method on {type(self).__name__}")
        self._effects.append(CancelTimer(name))

    def abort(self, reason: str = "aborted") -> None:
        """Stop going forward and compensate what was done (before the pivot only)."""
        self._effects.append(Abort(reason))

    # -- what a loaded saga shows -------------------------------------------------------------

    @property
    def id(self) -> str:
        """The saga's id: its stream, ``saga-<name>-<key>``."""
        return f"{type(self).definition.stream_prefix}{self.key}"

    @property
    def key(self) -> str:
        """The saga's key (the start event's key field)."""
        return str(self._meta.get("key", ""))

    @property
    def status(self) -> str:
        """``pending``, ``running``, ``completed``, ``compensating``, ``compensated`` or
        ``failed``."""
        return str(self._meta.get("status", "running"))

    @property
    def history(self) -> list[Any]:
        """The transitions, oldest first (``Transition`` items)."""
        return list(self._meta.get("history", []))

    @property
    def reason(self) -> str | None:
        """Why the saga failed or was compensated, if it did."""
        return self._meta.get("reason")
