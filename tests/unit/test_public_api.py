"""The declared public API: ``eventflow.__all__`` is what docs/api.md lists, and every name
the README and docs/ import from ``eventflow`` is exported."""

import inspect
import re
from pathlib import Path

import pytest

import eventflow

ROOT = Path(__file__).resolve().parents[2]
API_PAGE = ROOT / "docs" / "api.md"
# Pages that tell users what to import: the README and every page under docs/.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A name docs/api.md lists: a bullet starting with the name in backticks.
_LISTED = re.compile(r"^- `([A-Za-z_][A-Za-z0-9_]*)`", re.MULTILINE)
# `from eventflow import A, B` on one line, or `from eventflow import (A, B,\n C)`.
_IMPORT = re.compile(r"^\s*from eventflow import (\([^)]*\)|[^\n]*)", re.MULTILINE)


def listed_names(text: str) -> list[str]:
    """The names a page lists as bullets, in order."""
    return _LISTED.findall(text)


def imported_names(text: str) -> set[str]:
    """The names a page imports from ``eventflow`` (the package itself, not a submodule)."""
    names: set[str] = set()
    for group in _IMPORT.findall(text):
        for part in group.strip("()").replace("\n", ",").split(","):
            name = part.split("#")[0].split(" as ")[0].strip()
            if name:
                names.add(name)
    return names


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
    "PublishUnconfirmedError",
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


def test_the_api_page_lists_exactly_all() -> None:
    listed = listed_names(API_PAGE.read_text(encoding="utf-8"))
    assert len(listed) == len(set(listed)), "docs/api.md lists a name twice"
    exported = set(eventflow.__all__)
    unlisted, unexported = exported - set(listed), set(listed) - exported
    assert not unlisted, f"exported, not in docs/api.md: {sorted(unlisted)}"
    assert not unexported, f"in docs/api.md, not exported: {sorted(unexported)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_names_the_docs_import_from_eventflow_are_exported(page: Path) -> None:
    unexported = imported_names(page.read_text(encoding="utf-8")) - set(eventflow.__all__)
    assert not unexported, f"imported from eventflow, not exported: {sorted(unexported)}"


def test_the_doc_parsers_read_lists_and_imports() -> None:
    page = """
- `App`: a service.
- `subscribe`: marks a handler.
  - `nested`: not a listed name.
text `Event` in a sentence
```python
from eventflow import App, Event  # a comment
from eventflow import (
    Aggregate,
    on as applier,
)
from eventflow.brokers import open_broker
```
"""
    assert listed_names(page) == ["App", "subscribe"]
    assert imported_names(page) == {"App", "Event", "Aggregate", "on"}


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
    assert issubclass(ef.PublishUnconfirmedError, ef.BrokerError)
    assert not issubclass(ef.PublishUnconfirmedError, ef.MessageRefusedError)


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
