"""Capabilities a store declares on its port (``durable``, ``supports_sql``,
``outbox.added``, ``outbox.relaying``), and a broker on its (``lag``, asked by sagas),
decide what the core does; an adapter that lacks one gets a ``ConfigurationError`` naming
the port, not a silently different behaviour."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest

from eventflow import App, ConfigurationError, Event, Saga
from eventflow.adapters.memory.store import MemoryDeadLetterStore, MemoryStore
from eventflow.brokers import open_broker
from eventflow.cli import main
from eventflow.envelope import Envelope
from eventflow.ports import Outbox, OutboxMessage, Store, declared
from eventflow.projections import Projection, ProjectionRunner
from eventflow.runtime.relay import OutboxRelay
from eventflow.stores import store_for


class NoCapabilities(Projection, name="capabilities_none"):
    """A projection with no handlers."""


class OldOutbox:
    """An outbox written before ``added`` was declared."""

    async def add(self, messages: Sequence[tuple[str, Envelope]], *, tx: Any = None) -> None:
        """Not used."""

    async def pending(self, limit: int = 100) -> list[OutboxMessage]:
        """Nothing pending."""
        return []

    async def remove(self, seqs: Sequence[int], *, lease: Any = None) -> None:
        """Not used."""


class OldStore:
    """A third-party store written before ``durable`` and ``supports_sql`` were declared."""

    url = "old://store"

    def __init__(self) -> None:
        self.outbox = OldOutbox()
        self.dead_letters = MemoryDeadLetterStore()


def test_declared_names_the_port_and_the_member() -> None:
    with pytest.raises(ConfigurationError, match=r"OldStore lacks 'durable'.*ports\.Store"):
        declared(OldStore(), Store, "durable")
    assert declared(MemoryStore(), Store, "durable") is False


def test_built_in_stores_declare_what_they_do(tmp_path: Path) -> None:
    memory = store_for("memory://")
    sqlite = store_for(f"sqlite:///{tmp_path / 'x.db'}")
    in_memory_sqlite = store_for("sqlite:///:memory:")
    postgres = store_for("postgresql://postgres@127.0.0.1/test")  # not opened
    assert (memory.durable, memory.supports_sql) == (False, False)
    assert (sqlite.durable, sqlite.supports_sql) == (True, True)
    assert (in_memory_sqlite.durable, in_memory_sqlite.supports_sql) == (False, True)
    assert (postgres.durable, postgres.supports_sql) == (True, True)


def test_projection_state_is_atomic_where_the_store_runs_sql(tmp_path: Path) -> None:
    sqlite = store_for(f"sqlite:///{tmp_path / 'x.db'}")
    assert ProjectionRunner(NoCapabilities(), MemoryStore()).atomic_state is False
    assert ProjectionRunner(NoCapabilities(), sqlite).atomic_state is True
    # given explicitly, it wins over the store's capability
    assert ProjectionRunner(NoCapabilities(), sqlite, atomic_state=False).atomic_state is False


def test_a_store_without_supports_sql_needs_atomic_state_given() -> None:
    store = cast(Store, OldStore())
    with pytest.raises(ConfigurationError, match="supports_sql"):
        ProjectionRunner(NoCapabilities(), store)
    assert ProjectionRunner(NoCapabilities(), store, atomic_state=False).atomic_state is False


def test_an_outbox_without_added_is_refused_by_the_relay() -> None:
    store = cast(Store, OldStore())
    with pytest.raises(ConfigurationError, match=r"OldOutbox lacks 'added'.*ports\.Outbox"):
        OutboxRelay(store, open_broker("memory://"))
    OutboxRelay(MemoryStore(), open_broker("memory://"))  # the control


@pytest.mark.parametrize("url", ["memory://", "sqlite:///:memory:"])
def test_the_cli_refuses_a_store_that_is_not_durable(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "list", "--store", url]) == 2
    err = capsys.readouterr().err
    assert "lives inside the app's process" in err and url in err


def test_the_cli_names_what_a_third_party_store_lacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "old_store_app.py").write_text(
        "from eventflow import App\n"
        "from test_store_capabilities import OldStore\n"
        "app = App('old', store=OldStore())\n"
    )
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    assert main(["dlq", "list", "--app", "old_store_app:app", "--app-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "OldStore lacks 'durable'" in err


class AddedOutbox(OldOutbox):
    """An outbox written after ``added`` and before ``relaying`` were declared."""

    def __init__(self) -> None:
        self.added = asyncio.Event()


def test_an_outbox_without_relaying_is_refused_by_the_relay() -> None:
    store = cast(Store, OldStore())
    store.outbox = AddedOutbox()  # type: ignore[misc]
    with pytest.raises(ConfigurationError, match=r"AddedOutbox lacks 'relaying'.*ports\.Outbox"):
        OutboxRelay(store, open_broker("memory://"))


def test_outbox_port_declares_added_and_relaying() -> None:
    assert "added" in dir(Outbox) and "relaying" in dir(Outbox)
    assert "durable" in dir(Store) and "supports_sql" in dir(Store)


class OldBroker:
    """A third-party broker written before ``Broker.lag`` was declared."""

    def __init__(self) -> None:
        self._inner = open_broker("memory://old-broker")
        self.url = self._inner.url

    async def start(self, supervisor: Any = None) -> None:
        await self._inner.start(supervisor)

    async def close(self) -> None:
        await self._inner.close()

    async def publish(self, topic: str, payload: bytes, **kw: Any) -> None:
        await self._inner.publish(topic, payload, **kw)

    async def subscribe(self, pattern: str, *, group: str, start: Any = "latest") -> Any:
        return await self._inner.subscribe(pattern, group=group, start=start)


class CapPlaced(Event, type="captest.order.placed"):
    order_id: str


class CapSaga(Saga, name="captest.order", start=CapPlaced, key="order_id"):
    """A saga with nothing to do but start."""

    order_id: str = ""


async def test_an_app_with_sagas_refuses_a_broker_without_lag() -> None:
    app = App("old", broker=cast(Any, OldBroker()), sagas=[CapSaga])
    with pytest.raises(ConfigurationError, match=r"OldBroker lacks 'lag'.*ports\.Broker"):
        await app.start()
    await app.stop()
    async with App("old", broker=cast(Any, OldBroker())):  # no sagas: not needed
        pass
