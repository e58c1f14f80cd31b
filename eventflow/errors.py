"""The exceptions eventflow raises, all rooted at :class:`EventflowError`.

::

    EventflowError
    ├── ConfigurationError          wrong arguments, URLs or wiring; fix the code or the URL
    │   └── MissingDependencyError  (also ImportError) a driver extra is not installed
    ├── EventTypeError              duplicate or unknown event type / version registration
    ├── DecodeError                 a message cannot become a typed event; dead-lettered at once
    │   ├── MalformedMessageError   bytes that are not a valid envelope
    │   ├── UnknownEventTypeError   a type (or version) the app does not know
    │   ├── FutureVersionError      a version newer than the code's
    │   ├── UpcastError             an upcaster chain is missing or failed
    │   └── EventValidationError    the payload fails the event model's validation
    ├── BackpressureError           a bounded queue stayed full past the publish timeout
    ├── HandlerTimeoutError         a handler ran past its soft timeout
    ├── RequestTimeoutError         (also TimeoutError) ``app.request`` got no reply in time
    ├── Reject                      raised by a handler: a permanent failure, dead-lettered at once
    ├── RetryLater                  raised by a handler: try again no sooner than ``after`` s
    ├── BrokerError                 the broker failed or was used after close
    │   ├── MessageRefusedError     the broker refused a message for good (too large, ...)
    │   └── PublishUnconfirmedError a publish not confirmed: maybe sent (a retry is safe)
    ├── ComponentFailedError        a background component failed and could not recover
    ├── IdleTimeoutError            (also TimeoutError) ``app.wait_idle`` found work still busy
    ├── GivenBack                   (eventflow.limits) a limit gave the message back, no attempt
    │   ├── CircuitOpenError        the limit's circuit breaker is open
    │   └── LimitTimeoutError       no slot or rate token came free within the limit's timeout
    ├── ProjectionError             a projection cannot run, reset or rebuild
    │   ├── ProjectionHandlerError  a handler raised on an event: the batch rolled back
    │   └── ProjectionLockedError   another instance holds the projection's lease
    ├── StoreError                  the store failed or was used after close
    │   ├── AlreadyHandled          a dedup entry already exists (a concurrent copy committed)
    │   ├── LeaseLostError          a lease expired or was taken over; its writes are refused
    │   ├── ConcurrencyError        optimistic concurrency conflict on append
    │   └── AggregateNotFound       no stream for the aggregate id
    └── DeadLetterNotFound          a dead-letter id that does not exist

Every message says what happened and what to do next.
"""

from __future__ import annotations

__all__ = [
    "AggregateNotFound",
    "AlreadyHandled",
    "BackpressureError",
    "BrokerError",
    "ComponentFailedError",
    "ConcurrencyError",
    "ConfigurationError",
    "DeadLetterNotFound",
    "DecodeError",
    "EventTypeError",
    "EventValidationError",
    "EventflowError",
    "FutureVersionError",
    "HandlerTimeoutError",
    "IdleTimeoutError",
    "LeaseLostError",
    "MalformedMessageError",
    "MessageRefusedError",
    "MissingDependencyError",
    "PublishUnconfirmedError",
    "Reject",
    "RequestTimeoutError",
    "RetryLater",
    "StoreError",
    "UnknownEventTypeError",
    "UpcastError",
]


class EventflowError(Exception):
    """Root of every error raised by eventflow."""


class ConfigurationError(EventflowError):
    """The app, a handler or a URL is configured wrongly; the message says how to fix it."""


class MissingDependencyError(ConfigurationError, ImportError):
    """A driver is not installed; the message names the extra (``pip install eventflow[x]``)."""

    def __init__(self, package: str, extra: str) -> None:
        super().__init__(
            f"the {package!r} package is required for this adapter; "
            f"install it with: pip install 'eventflow[{extra}]'"
        )
        self.package = package
        self.extra = extra


class EventTypeError(EventflowError):
    """An event type or version was registered twice, or is not registered."""


class DecodeError(EventflowError):
    """A message cannot be turned into a typed event. Such messages are dead-lettered at once."""

    reason = "decode-error"


class MalformedMessageError(DecodeError):
    """The bytes are not a valid eventflow envelope (not JSON, missing fields, wrong types)."""

    reason = "malformed"


class UnknownEventTypeError(DecodeError):
    """The envelope's type is not one this app (or this handler) knows."""

    reason = "unknown-type"


class FutureVersionError(DecodeError):
    """The envelope's version is newer than the newest version known to the code."""

    reason = "future-version"


class UpcastError(DecodeError):
    """No upcaster path from the envelope's version, or an upcaster raised."""

    reason = "upcast-failed"


class EventValidationError(DecodeError):
    """The payload does not validate against the event model."""

    reason = "invalid-payload"


class BackpressureError(EventflowError):
    """A bounded queue stayed full for longer than the publish timeout.

    Consumers are not keeping up: add consumers, raise ``concurrency``, or slow the producer.
    """


class IdleTimeoutError(EventflowError, TimeoutError):
    """``app.wait_idle(timeout=...)`` found work still busy when its timeout ran out; the
    message names what (a group's lag on a pattern, handlings in flight, outbox rows,
    projections behind). ``busy`` holds the same as lines."""

    def __init__(self, message: str, busy: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.busy = busy


class HandlerTimeoutError(EventflowError):
    """A handler ran past its soft ``timeout`` and was cancelled; counts as a failed attempt."""


class RequestTimeoutError(EventflowError, TimeoutError):
    """``app.request`` got no reply of the expected types within its ``timeout``.

    The command stays sent: a participant may still handle it, and a reply that comes later
    is dropped (counted as ``late`` in ``app.stats()["requests"]``). Ask again only if the
    command is safe to repeat, look the outcome up where the participant records it, or
    raise the timeout. ``command_id`` is the command's envelope id, ``expected`` the reply
    types waited for and ``timeout`` the seconds waited.
    """

    def __init__(self, command_id: str, expected: tuple[str, ...], timeout: float) -> None:
        super().__init__(
            f"no reply of type {' | '.join(expected)} to command {command_id} within "
            f"{timeout:g}s; the command was sent and may still be handled (a later reply "
            "is dropped): raise the timeout, or check the participant is running"
        )
        self.command_id = command_id
        self.expected = expected
        self.timeout = timeout


class Reject(EventflowError):
    """Raise it in a handler when the failure is permanent, as a business rejection is
    (``raise Reject("not enough sku-b")``): the message is dead-lettered at once with reason
    ``rejected`` and this text as its error, without retries. Exceptions listed in
    ``@subscribe(..., give_up_on=(...))`` are treated alike.

    ``reason`` is the dead letter's reason (``rejected``), as on every error that ends in
    the dead-letter queue; the text given here is ``str(exc)`` and the letter's ``error``.
    """

    reason = "rejected"

    def __init__(self, reason: str) -> None:
        if not isinstance(reason, str) or not reason:
            raise TypeError(
                f"Reject takes the text that says why, e.g. Reject('not enough stock'), "
                f"got {reason!r}"
            )
        super().__init__(reason)


class RetryLater(EventflowError):
    """Raise it in a handler to have the message tried again no sooner than ``after``
    seconds from now (a provider's ``Retry-After``), instead of the retry policy's backoff.

    The attempt counts: the next one is ``ctx.attempt + 1``, and past the subscription's
    ``retry`` attempts the message is dead-lettered as usual. The wait is kept by the
    broker (the message is given back with a delay), not by a worker: the subscription's
    other keys keep flowing meanwhile; later messages of the same key wait, in order.
    """

    def __init__(self, after: float, reason: str = "") -> None:
        if (
            isinstance(after, bool)
            or not isinstance(after, int | float)
            or not 0 <= after < float("inf")
        ):
            raise TypeError(
                f"RetryLater(after=...) takes a number of seconds >= 0, got {after!r}; "
                "parse a Retry-After header into seconds first"
            )
        self.after = float(after)
        text = f"retry no sooner than {self.after:g}s from now"
        super().__init__(f"{reason}: {text}" if reason else text)


class BrokerError(EventflowError):
    """The broker failed, or was used before start or after close."""


class MessageRefusedError(BrokerError):
    """The broker refused a message for good: it is too large, the client may not publish
    to its topic, or the topic is invalid. Sending it again changes nothing: a consumer
    dead-letters the message whose handler published it (reason ``publish-refused``) and the
    outbox relay parks the row in the dead-letter queue."""

    reason = "publish-refused"


class PublishUnconfirmedError(BrokerError):
    """A publish the broker did not confirm although the message may have reached it (a
    timeout waiting for the acknowledgement, a connection lost after sending): it is maybe
    sent, and may be delivered. Publishing the same envelope again is safe: consumers drop
    a second copy by its envelope id (on NATS the stream's duplicate window drops a retry
    within it before it is stored). Any other ``BrokerError`` from ``publish`` means the
    message was not sent."""


class ComponentFailedError(EventflowError):
    """A background component of an app (a consumer, a relay, a projection runner, an
    adapter's own loop) failed and could not recover: its error is not transient, or it
    kept failing past the restart policy's ``give_up_after``. ``component`` names it and
    ``__cause__`` is its last error. Fix the cause and start the app again."""

    def __init__(self, component: str, message: str) -> None:
        super().__init__(message)
        self.component = component


class StoreError(EventflowError):
    """The store failed, or was used before open or after close."""


class AlreadyHandled(StoreError):
    """The (group, message id) dedup entry already exists: another copy of the message was
    handled and committed first. Raised by ``Store.mark_handled`` inside a transaction
    (or, on SQLite, where that transaction ends, rolled back), which the consumer then
    rolls back and acks as a duplicate."""

    def __init__(self, group: str, message_id: str) -> None:
        super().__init__(
            f"message {message_id!r} was already handled by group {group!r}; its copy is skipped"
        )
        self.group = group
        self.message_id = message_id


class LeaseLostError(StoreError):
    """A lease was lost: it expired before its holder renewed it, or another instance took
    it over. The block holding it is cancelled and ends with this error, and the store
    refuses every write made with the lost lease's epoch (a fencing token), so a paused or
    partitioned former holder cannot commit. Holders such as projection runners and relays
    wait for the lease again."""

    def __init__(self, name: str, epoch: int, why: str) -> None:
        super().__init__(f"lease {name!r} (epoch {epoch}) was lost: {why}")
        self.name = name
        self.epoch = epoch


class ConcurrencyError(StoreError):
    """An append's ``expected_version`` did not match the stream's current version.

    Reload the aggregate and retry the command (``Repository.update`` does this).
    """

    def __init__(self, stream: str, expected: int | None, actual: int) -> None:
        super().__init__(
            f"stream {stream!r} is at version {actual}, not the expected {expected}; "
            "reload it and retry the command"
        )
        self.stream = stream
        self.expected = expected
        self.actual = actual


class AggregateNotFound(StoreError):
    """No stream exists for the aggregate id; create a new aggregate instead of loading it."""


class DeadLetterNotFound(EventflowError):
    """A dead-letter id does not exist (already purged or replayed?); list them to check."""
