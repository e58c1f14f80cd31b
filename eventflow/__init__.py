"""eventflow: versioned events, idempotent consumers, dead letters and an event store."""

from .app import App
from .context import Context
from .envelope import Envelope
from .errors import (
    AggregateNotFound,
    AlreadyHandled,
    BackpressureError,
    BrokerError,
    ComponentFailedError,
    ConcurrencyError,
    ConfigurationError,
    DeadLetterNotFound,
    DecodeError,
    EventflowError,
    EventTypeError,
    EventValidationError,
    FutureVersionError,
    HandlerTimeoutError,
    IdleTimeoutError,
    LeaseLostError,
    MalformedMessageError,
    MessageRefusedError,
    MissingDependencyError,
    PublishUnconfirmedError,
    Reject,
    RequestTimeoutError,
    RetryLater,
    StoreError,
    UnknownEventTypeError,
    UpcastError,
)
from .events import Event, EventRegistry, upcaster
from .fanout import Gathered, GatherResult
from .limits import Breaker, CircuitOpenError, Limit, LimitTimeoutError
from .ports import DeadLetter, Lag, RecordedEvent, Transaction
from .projections import Projection, ProjectionContext
from .runtime.retry import RetryPolicy
from .sagas import Saga, on_timer, step
from .sourcing import Aggregate, Repository, on
from .stores import open_store
from .subscribe import subscribe
from .supervision import RestartPolicy

__version__ = "0.1.0"

__all__ = (
    "Aggregate",
    "AggregateNotFound",
    "AlreadyHandled",
    "App",
    "BackpressureError",
    "Breaker",
    "BrokerError",
    "CircuitOpenError",
    "ComponentFailedError",
    "ConcurrencyError",
    "ConfigurationError",
    "Context",
    "DeadLetter",
    "DeadLetterNotFound",
    "DecodeError",
    "Envelope",
    "Event",
    "EventRegistry",
    "EventTypeError",
    "EventValidationError",
    "EventflowError",
    "FutureVersionError",
    "GatherResult",
    "Gathered",
    "HandlerTimeoutError",
    "IdleTimeoutError",
    "Lag",
    "LeaseLostError",
    "Limit",
    "LimitTimeoutError",
    "MalformedMessageError",
    "MessageRefusedError",
    "MissingDependencyError",
    "Projection",
    "ProjectionContext",
    "PublishUnconfirmedError",
    "RecordedEvent",
    "Reject",
    "Repository",
    "RequestTimeoutError",
    "RestartPolicy",
    "RetryLater",
    "RetryPolicy",
    "Saga",
    "StoreError",
    "Transaction",
    "UnknownEventTypeError",
    "UpcastError",
    "on",
    "on_timer",
    "open_store",
    "step",
    "subscribe",
    "upcaster",
)
