"""The broker + store setups the saga tests run on, in one place.

``saga_setup`` is parametrized over memory + memory, memory + SQLite, NATS + PostgreSQL and
Kafka (Tansu) + PostgreSQL. Each test gets a place of its own that several apps can share
(a participants' app and a saga's app, or one app stopped and started again):

- memory broker: the test's unique hub name, kept open by the ``hub`` fixture all test long;
- memory store: one ``MemoryStore`` instance (two apps share saga state only through it);
- SQLite: one file in the test's ``tmp_path``;
- NATS: the session's ``nats-server`` with a stream (and so subjects, consumers and lease
  buckets) of the test's own, in memory storage;
- Kafka: the session's Tansu broker with a topic prefix of the test's own;
- PostgreSQL: a schema of the test's own (``isolated_schema``), dropped afterwards.

The servers are the session's ``nats_url`` and ``kafka_url`` and the test's ``postgres_url``
schema, from the package's pytest plugin (``eventflow.testing.plugin``). Without NATS, Kafka
or PostgreSQL those tests skip, and fail under ``CI=true``, as every service test does.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eventflow import App
from eventflow.adapters.memory import MemoryBroker, MemoryStore
from eventflow.ports import Store


@dataclass
class Setup:
    """Where a test's apps meet: ``app(...)`` builds an app on the test's broker and store."""

    name: str
    broker_url: str
    store: str | Store
    groups: str
    """A prefix for the participants' consumer groups, unique to the test."""

    def app(self, name: str, **kwargs: Any) -> App:
        """An app on this setup's broker and store (every call: the same place)."""
        return App(name, broker=self.broker_url, store=self.store, **kwargs)


SERVICES = [
    pytest.param("memory-sqlite", id="memory-sqlite"),
    pytest.param("nats-postgres", id="nats-postgres", marks=pytest.mark.service("nats")),
    pytest.param("kafka-postgres", id="kafka-postgres", marks=pytest.mark.service("kafka")),
]
"""memory + SQLite and the real servers: ``parametrize("saga_setup", SERVICES, indirect=True)``."""
SETUPS = [pytest.param("memory-memory", id="memory-memory"), *SERVICES]
"""Every setup (the default of ``saga_setup``): also two apps sharing one memory store."""


@pytest.fixture(params=SETUPS)
def saga_setup(
    request: pytest.FixtureRequest, tmp_path: Path, broker_url: str, hub: MemoryBroker
) -> Setup:
    """One broker + store setup (see the module docstring)."""
    kind: str = request.param
    unique = uuid.uuid4().hex[:10]
    fetch: Callable[[str], Any] = request.getfixturevalue
    if kind == "memory-memory":
        return Setup(kind, broker_url, MemoryStore(), f"shop{unique}")
    if kind == "memory-sqlite":
        return Setup(kind, broker_url, f"sqlite:///{tmp_path / 'sagas.db'}", f"shop{unique}")
    store = fetch("postgres_url")
    if kind == "nats-postgres":
        nats = fetch("nats_url")
        url = f"{nats}?stream=EFSAGA{unique}&storage=memory"
        return Setup(kind, url, store, f"shop{unique}")
    assert kind == "kafka-postgres", kind
    kafka = fetch("kafka_url")
    return Setup(kind, f"{kafka}&topic_prefix=t{unique}.", store, f"shop{unique}")
