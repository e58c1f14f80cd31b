"""A projection runner decodes with its registry (an app's): the handler's event and
``ctx.record.event`` are both upcast by it, not by the default registry."""

from __future__ import annotations

from typing import Any

from projection_support import Waiter, running

from eventflow import App, Event
from eventflow.adapters.memory.store import MemoryStore
from eventflow.events import EventRegistry, default_registry, to_envelope, upcaster
from eventflow.projections import Projection, ProjectionContext, ProjectionRunner
from eventflow.sourcing.on import on


class Renamed1(Event, type="projreg.renamed", version=1):
    """The first version: a full name."""

    name: str


class Renamed(Event, type="projreg.renamed", version=2):
    """The current version: a name and where the upcaster that made it came from."""

    name: str
    via: str


def _registry(via: str) -> EventRegistry:
    registry = EventRegistry()
    registry.register(Renamed1)
    registry.register(Renamed)

    @upcaster("projreg.renamed", from_version=1, registry=registry)
    def _up(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "via": via}

    return registry


class Names(Projection, name="projreg_names"):
    """Keeps what its handler got and what ``ctx.record.event`` decodes to."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    @on(Renamed)
    async def _renamed(self, e: Renamed, ctx: ProjectionContext) -> None:
        assert ctx.record is not None
        record_event = ctx.record.event
        assert isinstance(record_event, Renamed)
        self.seen.append((e.via, record_event.via))


async def _store_v1() -> MemoryStore:
    store = MemoryStore()
    await store.append("names-1", [to_envelope(Renamed1(name="Ada"), source="")])
    return store


async def _seen_with(registry: EventRegistry, waiter: Waiter) -> list[tuple[str, str]]:
    """What a runner with ``registry`` hands the projection for a stored v1 event."""
    projection = Names()
    runner = ProjectionRunner(projection, await _store_v1(), registry=registry)
    async with running(runner):
        await waiter(lambda: bool(projection.seen), what="the event handled")
    return projection.seen


async def test_runner_decodes_handler_events_and_records_with_its_registry(
    waiter: Waiter,
) -> None:
    assert await _seen_with(_registry("first"), waiter) == [("first", "first")]
    assert await _seen_with(_registry("second"), waiter) == [("second", "second")]
    assert ("projreg.renamed", 1) not in default_registry.upcasters()


async def test_app_projections_use_the_app_registry(waiter: Waiter) -> None:
    store = await _store_v1()
    projection = Names()
    async with App("names", store=store, projections=[projection], registry=_registry("app")):
        await waiter(lambda: bool(projection.seen), what="the event handled")
    assert projection.seen == [("app", "app")]
