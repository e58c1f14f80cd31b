"""``@subscribe``: marks an async function as a handler. It registers nothing globally;
``App(handlers=[...])`` collects marked functions (and those of listed modules)."""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar, Union

from .envelope import Envelope
from .errors import ConfigurationError
from .events import Event
from .groups import DEFAULT_START, check_start
from .patterns import matches, validate_pattern
from .ports import StartPosition
from .runtime.retry import DEFAULT_MAX_ATTEMPTS, RetryPolicy

__all__ = [
    "DEFAULT_MAX_DELIVERIES",
    "DEFAULT_TIMEOUT",
    "HandlerSpec",
    "check_reachable",
    "collect_handlers",
    "subscribe",
]

DEFAULT_TIMEOUT = 30.0
DEFAULT_MAX_DELIVERIES = 10
_MARK = "__eventflow_subscriptions__"
Handler = Callable[..., Awaitable[Any]]
H = TypeVar("H", bound=Handler)


@dataclass(frozen=True, slots=True)
class HandlerSpec:
    """One ``@subscribe`` declaration: the function and its consumer settings."""

    fn: Handler
    pattern: str
    group: str | None
    concurrency: int
    retry: RetryPolicy
    timeout: float | None
    dead_letter: bool
    idempotent: bool
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    any_topic: bool = False
    start: StartPosition = DEFAULT_START
    give_up_on: tuple[type[BaseException], ...] = ()
    hard_timeout: float | None = None
    dedup_at_commit: bool = False
    """The handling always opens ``ctx.transaction()`` and has no effect outside it (what it
    sends goes through the outbox), so a copy of a handled message is found where its dedup
    entry is written in that transaction (``AlreadyHandled``: rolled back, acked as a
    duplicate) and the dedup check before the handler is skipped, a statement less per
    message. The saga runtime's handlers; not offered by ``@subscribe``, whose handlers may
    do anything."""

    @property
    def name(self) -> str:
        """``module.qualname`` of the handler, for logs and status."""
        return f"{self.fn.__module__}.{self.fn.__qualname__}"


def subscribe(
    pattern: str,
    *,
    group: str | None = None,
    concurrency: int = 1,
    retry: int | RetryPolicy | None = DEFAULT_MAX_ATTEMPTS,
    timeout: float | None = DEFAULT_TIMEOUT,
    dead_letter: bool = True,
    idempotent: bool = True,
    max_deliveries: int = DEFAULT_MAX_DELIVERIES,
    any_topic: bool = False,
    start: StartPosition = DEFAULT_START,
    give_up_on: Iterable[type[BaseException]] = (),
    hard_timeout: float | None = None,
) -> Callable[[H], H]:
    """Mark an ``async def handler(event, ctx)`` to consume topics matching ``pattern``.

    - ``group``: the consumer group (default: the app's name). Every group gets every message;
      members of one group share them.
    - ``concurrency``: messages of different keys handled in parallel; one key stays in order.
    - ``retry``: at most this many attempts in all, the first included (``retry=1`` or
      ``None``: one attempt, no retries; 0 or less is refused), or a ``RetryPolicy``.
    - ``timeout``: soft limit in seconds per attempt; the handler is cancelled past it.
    - ``dead_letter``: after the last failed attempt, keep the message in the dead-letter
      queue (default) rather than dropping it with an error log.
    - ``idempotent``: skip envelope ids this group already handled (dedup store).
    - ``max_deliveries``: a message whose handler was started this many times without ever
      finishing (the process died each time) is dead-lettered as a crash loop. Messages
      a dying process had fetched but not started are not charged; neither is a failure
      around the handler (the store or the broker), which gives the message back untouched.
    - ``any_topic``: the handler's event types arrive on topics not named after them
      (publishers send them with ``topic=...``), so its pattern is not checked against them.
    - ``start``: where the group begins when it does not exist yet on the broker: at the
      end of its topics (``"latest"``, the default: messages published before its first
      start are not delivered to it) or at the oldest message the broker keeps
      (``"earliest"``). An existing group keeps its position. ``eventflow groups declare
      MODULE:APP`` creates an app's groups ahead of its first start.
    - ``give_up_on``: exception types that mean the failure is permanent (a business
      rejection): the message is dead-lettered at once with reason ``rejected``, without
      retries, as when the handler raises ``eventflow.Reject``.
    - ``hard_timeout``: seconds after which a handler call that is still running (it ignored
      the soft ``timeout``'s cancellation, or blocks the event loop) makes the app log its
      stack and exit with status 70, so that a supervisor restarts it and the broker
      redelivers the message to another member. Must be above ``timeout``.

    Mistakes are refused here rather than at the first message: a bare ``@subscribe``
    (without the pattern), a pattern that is not a string, ``retry=0``, ``concurrency=0``,
    a ``start`` other than ``"latest"`` or ``"earliest"``.
    """
    _check_pattern_argument(pattern)
    validate_pattern(pattern)
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be >= 1, got {concurrency}")
    if timeout is not None and timeout <= 0:
        raise ConfigurationError(f"timeout must be > 0 seconds or None, got {timeout}")
    if (
        isinstance(max_deliveries, bool)
        or not isinstance(max_deliveries, int)
        or max_deliveries < 2
    ):
        raise ConfigurationError(
            f"max_deliveries must be an int >= 2 (deliveries whose handler never finished "
            f"before the message counts as a crash loop), got {max_deliveries!r}"
        )
    policy = RetryPolicy.of(retry)
    begin = check_start(start)
    permanent = _check_give_up_on(give_up_on)
    _check_hard_timeout(hard_timeout, timeout)

    def mark(fn: H) -> H:
        checked: Any = fn  # keep `fn` typed as H (the check below would narrow it)
        if not inspect.iscoroutinefunction(checked):
            raise ConfigurationError(
                f"@subscribe({pattern!r}) needs an `async def` function, got {fn!r}"
            )
        spec = HandlerSpec(
            fn,
            pattern,
            group,
            concurrency,
            policy,
            timeout,
            dead_letter,
            idempotent,
            max_deliveries,
            any_topic,
            begin,
            permanent,
            float(hard_timeout) if hard_timeout is not None else None,
        )
        specs = list(getattr(fn, _MARK, ()))
        specs.append(spec)
        setattr(fn, _MARK, tuple(specs))
        return fn

    return mark


def _check_give_up_on(types_: object) -> tuple[type[BaseException], ...]:
    """``give_up_on`` as a tuple of exception classes (one class alone is accepted too)."""
    if isinstance(types_, type):
        types_ = (types_,)
    if isinstance(types_, str) or not isinstance(types_, Iterable):
        raise ConfigurationError(
            f"give_up_on takes exception classes, e.g. give_up_on=(ValueError,), got {types_!r}"
        )
    found = tuple(types_)
    for cls in found:
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            raise ConfigurationError(
                f"give_up_on takes exception classes (subclasses of Exception), e.g. "
                f"give_up_on=(ValueError,), got {cls!r}"
            )
    return found


def _check_hard_timeout(hard_timeout: object, timeout: float | None) -> None:
    if hard_timeout is None:
        return
    if (
        isinstance(hard_timeout, bool)
        or not isinstance(hard_timeout, int | float)
        or not 0 < hard_timeout < float("inf")
    ):
        raise ConfigurationError(
            f"hard_timeout must be a number of seconds above 0 or None, got {hard_timeout!r}"
        )
    if timeout is None or hard_timeout <= timeout:
        raise ConfigurationError(
            f"hard_timeout={hard_timeout!r} needs a soft timeout below it (timeout={timeout!r}): "
            "the soft timeout cancels the handler first, the hard one ends the process; "
            "e.g. @subscribe(..., timeout=10, hard_timeout=30)"
        )


def _check_pattern_argument(pattern: object) -> None:
    if isinstance(pattern, str):
        return
    if callable(pattern):
        # `@subscribe` written without parentheses hands the function itself over here.
        name = getattr(pattern, "__name__", repr(pattern))
        raise ConfigurationError(
            f"@subscribe was used without its topic pattern on {name}: write "
            '@subscribe("topic.pattern", ...) above the function, e.g. '
            '@subscribe("order.placed", group="billing")'
        )
    raise ConfigurationError(
        f'@subscribe takes the topic pattern as a string, e.g. @subscribe("order.*"), '
        f"got {pattern!r}"
    )


def collect_handlers(items: Iterable[object]) -> list[HandlerSpec]:
    """Return the specs of marked functions in ``items`` (functions or modules), in order."""
    specs: list[HandlerSpec] = []
    for item in items:
        if isinstance(item, types.ModuleType):
            found = [v for v in vars(item).values() if getattr(v, _MARK, None)]
            if not found:
                raise ConfigurationError(
                    f"module {item.__name__!r} has no @subscribe functions; list the functions "
                    "or check the import"
                )
            for fn in found:
                specs.extend(getattr(fn, _MARK))
        elif callable(item) and getattr(item, _MARK, None):
            specs.extend(getattr(item, _MARK))
        else:
            raise ConfigurationError(
                f"{item!r} is not a @subscribe function or a module of them; "
                "decorate it with @subscribe(pattern) first"
            )
    return specs


@dataclass(frozen=True, slots=True)
class Signature:
    """What a handler's parameters ask for."""

    accepts: dict[str, type[Event]] | None
    """Event type name -> model class; None when the handler takes the raw Envelope."""
    any_event: bool
    """The handler takes ``Event`` itself: any registered type, at its latest version."""
    takes_context: bool


def inspect_handler(fn: Handler) -> Signature:
    """Read the first parameter's annotation: an Event class, a union of them, or Envelope."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if not 1 <= len(params) <= 2:
        raise ConfigurationError(
            f"handler {fn.__qualname__} must take (event) or (event, ctx), not "
            f"{len(params)} positional parameters"
        )
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise ConfigurationError(
            f"cannot resolve the annotations of handler {fn.__qualname__}: {exc}; "
            "import the event classes at module level"
        ) from exc
    hint = hints.get(params[0].name)
    takes_ctx = len(params) == 2
    if hint is Envelope:
        return Signature(None, False, takes_ctx)
    if hint is Event:
        return Signature({}, True, takes_ctx)
    members = (
        typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    )
    accepts: dict[str, type[Event]] = {}
    for member in members:
        if not (isinstance(member, type) and issubclass(member, Event) and member.event_type):
            raise ConfigurationError(
                f"handler {fn.__qualname__}: annotate the first parameter with an Event "
                f"subclass, a union of them, or Envelope (got {hint!r})"
            )
        if member.event_type in accepts:
            raise ConfigurationError(
                f"handler {fn.__qualname__} accepts two versions of {member.event_type!r}; "
                "take the latest and let upcasters convert older data"
            )
        accepts[member.event_type] = member
    return Signature(accepts, False, takes_ctx)


def check_reachable(bindings: Iterable[tuple[HandlerSpec, Signature]]) -> None:
    """Refuse a handler typed for an event that none of its patterns can deliver.

    An event is published to the topic named by its type, so a handler only ever sees the
    types its patterns match; any other class in its annotation is a mistake (a typo in the
    pattern, a copied decorator) that would otherwise show up as messages that never arrive.
    A function under several ``@subscribe`` decorators may take a union whose members each
    arrive through one of them. ``Envelope`` and ``Event`` annotations, and a handler marked
    ``any_topic=True`` (publishers send its events to other topics with ``topic=``), are not
    checked.
    """
    by_fn: dict[Handler, tuple[list[HandlerSpec], dict[str, type[Event]]]] = {}
    for spec, signature in bindings:
        if spec.any_topic:
            continue
        if signature.accepts:  # None (Envelope) and {} (Event) take anything
            by_fn.setdefault(spec.fn, ([], signature.accepts))[0].append(spec)
    for specs, accepts in by_fn.values():
        patterns = [s.pattern for s in specs]
        unreachable = [
            cls
            for event_type, cls in accepts.items()
            if not any(matches(p, event_type) for p in patterns)
        ]
        if unreachable:
            raise ConfigurationError(_unreachable_message(specs[0].name, patterns, unreachable))


def _unreachable_message(name: str, patterns: list[str], classes: list[type[Event]]) -> str:
    subscribed = " and ".join(map(repr, patterns))
    takes = ", ".join(f"{cls.__name__} (type {cls.event_type!r})" for cls in classes)
    example = classes[0].event_type
    return (
        f"handler {name} subscribes to {subscribed} but takes {takes}: an event is published "
        f"to the topic named by its type, which {subscribed} never matches, so the handler "
        f"would never receive it. Subscribe to a pattern that matches the type (e.g. "
        f"@subscribe({example!r})), or drop the class from the annotation; if publishers "
        "really send the event to another topic with topic=..., say so with "
        "@subscribe(..., any_topic=True)"
    )
