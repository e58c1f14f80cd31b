"""Test support for eventflow adapters: contract suites that every adapter must pass.

``eventflow.testing.broker_contract.BrokerContract`` is the Broker port's contract; an adapter's
test module subclasses it and provides a ``broker_factory`` fixture (see that module).
``eventflow.testing.store_contract.StoreContract`` is the event store's, with a
``store_factory`` fixture.
``eventflow.testing.dedup_contract.DedupContract`` is the DedupStore port's, with a
``dedup_factory`` fixture.
``eventflow.testing.sagas.SagaTest`` tests a saga in-process on a virtual clock
(docs/saga-testing.md).
``eventflow.testing.plugin`` is the pytest plugin (fixtures, docs/testing.md) and
``eventually`` the waiting helper.
This package imports pytest, so import it from tests only. Its names are imported on first
use, so that loading the pytest plugin (a submodule) does not load the contract suites.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .broker_contract import (
        BrokerContract,
        BrokerFactory,
        Member,
        broker_pool,
        collect,
        drain,
        unique_name,
    )
    from .dedup_contract import DedupContract, DedupFactory, dedup_pool
    from .sagas import SagaTest, SagaTestError
    from .store_contract import StoreContract, StoreFactory, store_pool
    from .waiting import eventually

_WHERE = {
    "BrokerContract": ".broker_contract",
    "BrokerFactory": ".broker_contract",
    "DedupContract": ".dedup_contract",
    "DedupFactory": ".dedup_contract",
    "Member": ".broker_contract",
    "SagaTest": ".sagas",
    "SagaTestError": ".sagas",
    "StoreContract": ".store_contract",
    "StoreFactory": ".store_contract",
    "broker_pool": ".broker_contract",
    "collect": ".broker_contract",
    "dedup_pool": ".dedup_contract",
    "drain": ".broker_contract",
    "eventually": ".waiting",
    "store_pool": ".store_contract",
    "unique_name": ".broker_contract",
}

__all__ = (
    "BrokerContract",
    "BrokerFactory",
    "DedupContract",
    "DedupFactory",
    "Member",
    "SagaTest",
    "SagaTestError",
    "StoreContract",
    "StoreFactory",
    "broker_pool",
    "collect",
    "dedup_pool",
    "drain",
    "eventually",
    "store_pool",
    "unique_name",
)


def __getattr__(name: str) -> Any:
    """Import a name of ``__all__`` from its submodule on first use."""
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value
