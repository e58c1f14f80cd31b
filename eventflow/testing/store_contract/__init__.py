"""The event store's contract suite (``EventStore`` and the ``Store`` parts built on it),
shared by every store adapter.

An adapter's test module subclasses :class:`StoreContract` and provides one fixture,
``store_factory``: a :class:`StoreFactory` returning stores connected to one fresh, empty
backend (a new file, database or schema per test), each like another process of the same
deployment, all closed after the test::

    class TestSqliteStore(StoreContract):
        @pytest.fixture
        async def store_factory(self, tmp_path: Path) -> AsyncIterator[StoreFactory]:
            url = f"sqlite:///{tmp_path}/events.db"
            async with store_pool(lambda: store_for(url)) as factory:
                yield factory

A single-process backend (memory) returns the same store every time. Because the backend
is fresh, positions start at 1 in every test; stream names are unique all the same.
Waits are bounded polls; a subclass on a slow backend raises ``timeout``.

Leases (``leases.py``): :class:`StoreContract` checks one holder at a time, epochs and
fenced writes on every store. The SQL stores add :class:`LeaseLossContract` (renewals
failing, a holder paused past its ttl, a holder killed), and PostgreSQL
:class:`ConnectionLossContract` (the holder's connections killed); both need a
``lease_faults`` fixture (:class:`LeaseFaults`) from the adapter's test module.
"""

from .append import AppendContract
from .atomic import TransactionalAppendContract
from .clock import ClockContract
from .concurrency import ConcurrencyContract
from .fences import FenceContract
from .leases import (
    ConnectionFaults,
    ConnectionLossContract,
    LeaseContract,
    LeaseFaults,
    LeaseLossContract,
    LeaseWatch,
)
from .reads import ReadContract
from .subscribe import SubscribeContract
from .support import (
    Follower,
    Happened,
    StoreFactory,
    following,
    happened,
    read_all,
    read_stream,
    store_pool,
)
from .transactions import TransactionContract

__all__ = [
    "ConnectionFaults",
    "ConnectionLossContract",
    "Follower",
    "Happened",
    "LeaseContract",
    "LeaseFaults",
    "LeaseLossContract",
    "LeaseWatch",
    "StoreContract",
    "StoreFactory",
    "following",
    "happened",
    "read_all",
    "read_stream",
    "store_pool",
]


# Bases in reverse: pytest runs inherited tests in reverse MRO order, so this runs the
# append tests first, then reads, subscribe, transactions (appends in them too), leases,
# fences, concurrency and the clock.
class StoreContract(
    ClockContract,
    ConcurrencyContract,
    FenceContract,
    LeaseContract,
    TransactionalAppendContract,
    TransactionContract,
    SubscribeContract,
    ReadContract,
    AppendContract,
):
    """The guarantees of :class:`eventflow.ports.EventStore` and of the transactional parts
    of :class:`eventflow.ports.Store`, as tests every store adapter must pass.

    Subclass it as ``class TestXStore(StoreContract)`` and provide the ``store_factory``
    fixture (see the module docstring). No ``Test`` prefix, so pytest collects it only
    through its subclasses.
    """
