"""Test support for eventflow adapters: contract suites that every adapter must pass.

``eventflow.testing.broker_contract.BrokerContract`` is the Broker port's contract; an adapter's
test module subclasses it and provides a ``broker_factory`` fixture (see that module).
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

__all__ = (
    "BrokerContract",
    "BrokerFactory",
    "Member",
    "broker_pool",
    "collect",
    "drain",
    "eventually",
    "unique_name",
)
