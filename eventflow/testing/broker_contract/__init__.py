"""The Broker port's contract suite, shared by every broker adapter.

An adapter's test module subclasses :class:`BrokerContract` and provides one fixture,
``broker_factory``: an async callable that returns a new, started broker connected to the
same backend (another "process" of the same deployment), closing them all after the test::

    class TestMemoryBroker(BrokerContract):
        @pytest.fixture
        async def broker_factory(self) -> AsyncIterator[BrokerFactory]:
            name = unique_name("hub")
            async with broker_pool(lambda: MemoryBroker(MemoryBrokerConfig(name=name))) as f:
                yield f

Every test uses fresh topic and group names, so a real server can be shared by all tests.
Waits are bounded polls; a subclass on a slow server raises ``timeout`` (how long to wait
for something that must happen) or ``quiet_period`` (how long to watch for something that
must not happen). ``max_message_bytes`` is the largest payload its brokers accept (1 MiB
by default, the default of every adapter); one built with a smaller limit says so there.

A network broker's module also subclasses :class:`StartupContract` (the first connection
bounded and interruptible), providing ``broker_at``.
"""

from .delivery import DeliveryContract
from .groups import GroupContract
from .lag import LagContract
from .redelivery import RedeliveryContract
from .starts import StartContract
from .startup import BrokerAt, StartupContract
from .support import (
    BrokerFactory,
    Member,
    SilentServer,
    broker_pool,
    collect,
    drain,
    eventually,
    unique_name,
)

__all__ = [
    "BrokerAt",
    "BrokerContract",
    "BrokerFactory",
    "LagContract",
    "Member",
    "SilentServer",
    "StartContract",
    "StartupContract",
    "broker_pool",
    "collect",
    "drain",
    "eventually",
    "unique_name",
]


# Bases in reverse: pytest runs inherited tests in reverse MRO order, so this runs the
# delivery tests first, then groups, then settling, redelivery and lifecycle, then lag,
# then where new groups begin.
class BrokerContract(
    StartContract, LagContract, RedeliveryContract, GroupContract, DeliveryContract
):
    """The guarantees of :class:`eventflow.ports.Broker`, as tests every adapter must pass.

    Subclass it as ``class TestXBroker(BrokerContract)`` and provide the ``broker_factory``
    fixture (see the module docstring). It has no ``Test`` prefix so that pytest collects it
    only through its subclasses.
    """
