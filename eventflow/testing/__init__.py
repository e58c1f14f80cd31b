"""Test support for eventflow adapters: contract suites that every adapter must pass.

``eventflow.testing.broker_contract.BrokerContract`` is the Broker port's contract; an adapter's
test module subclasses it and provides a ``broker_factory`` fixture (see that module).
``eventflow.testing.store_contract.StoreContract`` is the event store's, with a
``store_factory`` fixture.
``eventflow.testing.dedup_contract.DedupContract`` is the DedupStore port's, with a
``dedup_factory`` fixture.
``eventflow.testing.sagas.SagaTest`` tests a saga in-process on a virtual clock
(docs/saga-testing.md).
This package imports pytest, so import it from tests only.
"""

from .broker_contract import (
    BrokerContract,
    BrokerFactory,
    Member,
    broker_pool,
    collect,
    drain,
    eventually,
    unique_name,
)
from .dedup_contract import DedupContract, DedupFactory, dedup_pool
from .sagas import SagaTest, SagaTestError
from .store_contract import StoreContract, StoreFactory, store_pool

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
