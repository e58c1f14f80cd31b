"""Hops through the outbox, timed, and a process that only relays the outbox.

:class:`Hops` is a handler that publishes the next hop inside ``ctx.transaction()`` (one
message in flight, each sent by the outbox relay) and times them: the per-hop time is the
interval between two handler starts, one hop's commit, relay, broker and delivery.
:func:`compare` runs two setups in alternating rounds.

    PYTHONPATH=.:tests python tests/faults/hop_app.py BROKER_URL STORE_URL

runs an app without handlers on the store until SIGTERM, printing ``ready`` once its outbox
relay holds the store's relay lease: every message another instance writes to that store's
outbox is then sent by this process.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

from eventflow import App, Context, Event, subscribe
from eventflow.runtime.relay import OUTBOX_RELAY_LEASE
from eventflow.testing import unique_name
from faults.children import Child, child_store, launch, serve

HOPS = 200
ROUNDS = 4
DEADLINE = 20.0
"""Seconds a round of hops may take (at the 1 s idle poll of a relay that is not woken, 50
hops take about a minute)."""


class Hop(Event, type="fx.hops.hop"):
    """One hop; the handler publishes hop ``n + 1`` until ``n`` reaches ``last``."""

    n: int
    last: int


class Hops:
    """Rounds of sequential hops through ``ctx.transaction()`` and the outbox, timed."""

    def __init__(self) -> None:
        self.group = unique_name("hops")
        self.topic = f"fx.hops.{self.group}"  # a topic of its own: no other run's handler
        self.gaps: list[float] = []
        self._last_start: float | None = None
        self._done = asyncio.Event()

    def handler(self) -> Callable[[Hop, Context], Awaitable[None]]:
        """The ``@subscribe`` handler (a group and a topic of its own)."""

        @subscribe(self.topic, group=self.group, any_topic=True)
        async def hop(event: Hop, ctx: Context) -> None:
            now = time.perf_counter()
            if event.n > 0 and self._last_start is not None:
                self.gaps.append(now - self._last_start)
            self._last_start = now
            if event.n >= event.last:
                self._done.set()
                return
            async with ctx.transaction():
                await ctx.publish(Hop(n=event.n + 1, last=event.last), topic=self.topic)

        return hop

    async def round(self, app: App, hops: int) -> None:
        """Publish hop 0 from ``app`` and wait for hop ``hops``; fails past ``DEADLINE``."""
        self._done.clear()
        self._last_start = None
        before = len(self.gaps)
        await app.publish(Hop(n=0, last=hops), key="hops", topic=self.topic)
        try:
            async with asyncio.timeout(DEADLINE):
                await self._done.wait()
        except TimeoutError:
            raise AssertionError(
                f"{len(self.gaps) - before} of {hops} hops in {DEADLINE:g} s "
                f"({self.median():.1f} ms per hop so far)"
            ) from None

    def median(self) -> float:
        """The median time from one handler start to the next, in milliseconds."""
        return statistics.median(self.gaps) * 1000 if self.gaps else float("nan")


async def compare(one: tuple[App, Hops], across: tuple[App, Hops]) -> tuple[float, float]:
    """Median ms per hop of ``HOPS`` hops on each (app, hops), in ``ROUNDS`` alternating
    rounds, so that both see the same load of a shared machine."""
    for _ in range(ROUNDS):
        for app, hops in (one, across):
            await hops.round(app, HOPS // ROUNDS)
    return one[1].median(), across[1].median()


async def holds_relay(app: App) -> bool:
    """True once ``app``'s outbox relay holds its store's relay lease."""
    leases = app.store.leases
    return await leases.holder(OUTBOX_RELAY_LEASE) == leases.owner  # type: ignore[attr-defined]


class RelayProcess(Child):
    """A ``hop_app.py`` process holding the relay lease of a store."""

    @classmethod
    async def start(cls, broker: str, store: str) -> RelayProcess:
        """Start one and wait until its relay holds the lease."""
        return cls(await launch(__file__, broker, child_store(store), what="the relay process"))


async def _main(broker: str, store: str) -> None:
    app = App("fx-relay", broker=broker, store=store)
    await serve(app, ready=lambda: holds_relay(app))


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
