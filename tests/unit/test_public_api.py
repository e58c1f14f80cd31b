"""The declared public API: ``eventflow.__all__`` matches what DESIGN.md tells users to import."""

import inspect

import pytest

import eventflow

# Names DESIGN.md sections 1-4 tell users to import from ``eventflow`` (or catch from it).
DOCUMENTED = {
    # section 1
    "App",
    "Event",
    "Context",
    "subscribe",
    "upcaster",
    # section 2
    "Envelope",
    # section 3 / 3b
    "RetryPolicy",
    "BackpressureError",
    "DeadLetter",
    # section 4
    "Aggregate",
    "Projection",
    "Repository",
    "on",
    "open_store",
    "ConcurrencyError",
    "AggregateNotFound",
}
# Names documented but not built yet (none left).
NOT_YET_IMPLEMENTED: set[str] = set()
ERRORS = {
    "EventflowError",
    "ConfigurationError",
    "MissingDependencyError",
    "EventTypeError",
    "DecodeError",
    "MalformedMessageError",
    "UnknownEventTypeError",
    "FutureVersionError",
    "UpcastError",
    "EventValidationError",
    "BackpressureError",
    "HandlerTimeoutError",
    "BrokerError",
    "MessageRefusedError",
    "ComponentFailedError",
    "StoreError",
    "LeaseLostError",
    "ConcurrencyError",
    "AggregateNotFound",
    "DeadLetterNotFound",
}


def test_all_is_a_tuple_without_duplicates() -> None:
    assert isinstance(eventflow.__all__, tuple)
    assert len(set(eventflow.__all__)) == len(eventflow.__all__)


@pytest.mark.parametrize("name", eventflow.__all__)
def test_every_exported_name_is_importable_public_and_documented(name: str) -> None:
    assert not name.startswith("_")
    obj = getattr(eventflow, name)
    assert obj is not None
    if inspect.isclass(obj) or inspect.isfunction(obj):
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from eventflow import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(eventflow.__all__)


def test_documented_names_that_exist_are_exported() -> None:
    implemented = DOCUMENTED - NOT_YET_IMPLEMENTED
    assert implemented <= set(eventflow.__all__)
    # Once a section-4 name appears in the package it must be exported too.
    for name in NOT_YET_IMPLEMENTED:
        if hasattr(eventflow, name):
            assert name in eventflow.__all__


def test_the_error_tree_is_exported_under_one_root() -> None:
    assert set(eventflow.__all__) >= ERRORS
    for name in ERRORS:
        assert issubclass(getattr(eventflow, name), eventflow.EventflowError), name


def test_error_tree_shape() -> None:
    ef = eventflow
    for decode in (
        ef.MalformedMessageError,
        ef.UnknownEventTypeError,
        ef.FutureVersionError,
        ef.UpcastError,
        ef.EventValidationError,
    ):
        assert issubclass(decode, ef.DecodeError)
        assert decode.reason != ef.DecodeError.reason
    assert issubclass(ef.MissingDependencyError, ef.ConfigurationError)
    assert issubclass(ef.MissingDependencyError, ImportError)
    assert issubclass(ef.ConcurrencyError, ef.StoreError)
    assert issubclass(ef.AggregateNotFound, ef.StoreError)
    assert issubclass(ef.LeaseLostError, ef.StoreError)
    assert issubclass(ef.MessageRefusedError, ef.BrokerError)


def test_structured_errors_say_what_to_do() -> None:
    err = eventflow.ConcurrencyError("order-1", 3, 5)
    assert (err.stream, err.expected, err.actual) == ("order-1", 3, 5)
    assert "'order-1'" in str(err) and "3" in str(err) and "5" in str(err)
    assert "retry" in str(err)
    missing = eventflow.MissingDependencyError("aiokafka", "kafka")
    assert "pip install 'eventflow[kafka]'" in str(missing)
    assert (missing.package, missing.extra) == ("aiokafka", "kafka")


def test_documented_module_level_entry_points() -> None:
    from eventflow.brokers import open_broker
    from eventflow.cloudevents import from_cloudevent, to_cloudevent

    assert callable(open_broker) and callable(to_cloudevent) and callable(from_cloudevent)


def test_open_broker_and_store_urls() -> None:
    from eventflow.adapters.memory import MemoryBroker, MemoryStore
    from eventflow.adapters.sqlite import SqliteStore
    from eventflow.brokers import open_broker
    from eventflow.stores import store_for

    broker = open_broker("memory://ut-api")
    assert isinstance(broker, MemoryBroker)
    assert broker.url == "memory://ut-api"
    assert open_broker(broker) is broker
    assert isinstance(store_for("memory://"), MemoryStore)
    assert isinstance(store_for("sqlite:///ut-api.db"), SqliteStore)
    with pytest.raises(eventflow.ConfigurationError, match="unsupported broker URL"):
        open_broker("amqp://localhost")
    with pytest.raises(eventflow.ConfigurationError, match="unsupported store URL"):
        store_for("mongodb://localhost")


def test_version_is_a_string() -> None:
    assert isinstance(eventflow.__version__, str)
