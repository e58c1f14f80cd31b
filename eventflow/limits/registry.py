"""``Limits``: the limits an app declared, as its handlers take them (``ctx.limit(name)``).

Built with the app, opened with it: a cluster limit gets its backend then (the app's SQL
store, or Redis for ``backend="redis://..."``; one backend per URL, shared by the limits
that name it), and the app runs ``renew`` as a component while any cluster limit exists, so
the slots this process holds outlive its renewals by ``ttl`` at most.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from .._logging import Throttled
from ..errors import ConfigurationError
from ..ports import Store
from .breaker import Phase
from .limiter import Cell, Limiter, Slots, Taken
from .local import LocalCell, LocalSlots
from .shared import LimitBackend, SharedCell, SharedSlots
from .spec import Limit, check_limits

__all__ = ["Limits"]

_log = logging.getLogger("eventflow.limits")


def _backend_for(url: str) -> LimitBackend:
    from ..adapters.redis.limits import RedisLimitBackend

    return RedisLimitBackend.from_url(url)


class Limits:
    """The app's limits by name (``App(limits=[...])``)."""

    def __init__(self, limits: Iterable[object] = (), *, app: str = "app") -> None:
        self.declared: dict[str, Limit] = check_limits(limits)
        self.app = app
        self._limiters: dict[str, Limiter] = {}
        self._backends: dict[str, LimitBackend] = {}  # by URL ("" for the store's)
        self._shared: list[SharedSlots] = []
        self._throttled = Throttled(_log)

    @property
    def clustered(self) -> bool:
        """True if some limit is shared across instances (the app then runs ``renew``)."""
        return any(limit.scope == "cluster" for limit in self.declared.values())

    def __bool__(self) -> bool:
        return bool(self.declared)

    async def open(self, store: Store) -> None:
        """Build every limiter; connect the backends of cluster limits. Idempotent."""
        if self._limiters or not self.declared:
            return
        try:
            for name, limit in self.declared.items():
                self._limiters[name] = await self._build(limit, store)
        except BaseException:
            await self.close()
            raise

    async def _build(self, limit: Limit, store: Store) -> Limiter:
        slots: Slots
        cell: Cell | None = None
        if limit.scope == "process":
            slots = LocalSlots(limit)
            if limit.breaker is not None:
                cell = LocalCell(limit.breaker)
            return Limiter(limit, slots, cell)
        key = limit.backend or ""
        backend = self._backends.get(key)
        if backend is None:
            if limit.backend is not None:
                backend = _backend_for(limit.backend)
            else:
                from .sql import SqlLimitBackend

                backend = SqlLimitBackend.for_store(store, limit.name)
            await backend.open()
            self._backends[key] = backend
        shared = SharedSlots(limit, backend)
        self._shared.append(shared)
        if limit.breaker is not None:
            cell = SharedCell(limit, limit.breaker, backend)
        return Limiter(limit, shared, cell)

    async def close(self) -> None:
        """Disconnect the backends (slots still held expire after their ttl). Idempotent."""
        backends, self._backends = self._backends, {}
        self._limiters = {}
        self._shared = []
        for backend in backends.values():
            try:
                await backend.close()
            except Exception as exc:
                _log.warning("could not close a limit backend: %s", exc)

    def limiter(self, name: str) -> Limiter:
        """The limiter of ``name``; a ``ConfigurationError`` saying what to declare if none."""
        try:
            return self._limiters[name]
        except KeyError:
            pass
        if name in self.declared:
            raise ConfigurationError(
                f"limit {name!r} is taken before app {self.app!r} started: take it in a "
                "handler, or inside `async with app:`"
            )
        known = ", ".join(map(repr, sorted(self.declared))) or "none"
        raise ConfigurationError(
            f"no limit named {name!r} on app {self.app!r} (declared: {known}): declare it with "
            f"App(..., limits=[Limit({name!r}, concurrency=..., rate=...)])"
        )

    def take(self, name: str, timeout: float | None = None) -> Taken:
        """``async with limits.take(name):`` (what ``ctx.limit`` returns)."""
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0
        ):
            raise ConfigurationError(
                f"ctx.limit({name!r}, timeout=...) takes seconds >= 0, got {timeout!r}"
            )
        return self.limiter(name).take(timeout)

    async def renew(self) -> None:
        """Renew the slots this process holds, every ``ttl / 3`` (a component of the app)."""
        interval = min(lim.ttl for lim in self.declared.values() if lim.scope == "cluster") / 3
        while True:
            await asyncio.sleep(interval)
            for shared in self._shared:
                try:
                    await shared.renew()
                except Exception as exc:  # held slots may expire: others may then enter
                    self._throttled.warning(
                        f"renew:{shared.limit.name}",
                        "limit %s: could not renew this process's slots (%s); they expire "
                        "%.1fs after the last renewal",
                        shared.limit.name,
                        exc,
                        shared.limit.ttl,
                    )
                else:
                    self._throttled.clear(f"renew:{shared.limit.name}")

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per limit: entered, timed_out, refused, counted, in_use, and with a
        breaker its ``breaker_open`` (1 open, 2 half-open, 0 closed), ``opened``, ``closed``."""
        found: dict[str, dict[str, int]] = {}
        for name, limiter in self._limiters.items():
            s = limiter.stats
            row = {
                "entered": s.entered,
                "timed_out": s.timed_out,
                "refused": s.refused,
                "counted": s.counted,
                "in_use": limiter.slots.in_use,
            }
            cell = limiter.cell
            if cell is not None:
                state = cell.state
                row["breaker_open"] = _PHASE_CODES[state.phase]
                row["opened"] = state.opened
                row["closed"] = state.closed
            found[name] = row
        return found

    def problems(self) -> tuple[str, ...]:
        """A line per breaker that is not closed, for ``eventflow status``."""
        lines: list[str] = []
        for name, limiter in self._limiters.items():
            cell, breaker = limiter.cell, limiter.limit.breaker
            if cell is None or breaker is None or cell.state.phase is Phase.CLOSED:
                continue
            state = cell.state
            since = datetime.fromtimestamp(state.opened_at, UTC).strftime("%H:%M:%S")
            probe = datetime.fromtimestamp(state.retry_at(breaker.reset), UTC)
            lines.append(
                f"breaker {name} {state.phase.value.upper()} since {since} UTC "
                f"(opened {state.opened}x; {state.last_error or 'no error recorded'}); "
                f"next probe {probe.strftime('%H:%M:%S')} UTC; subscriptions taking it pause"
            )
        return tuple(lines)


_PHASE_CODES: Mapping[Phase, int] = {Phase.CLOSED: 0, Phase.OPEN: 1, Phase.HALF_OPEN: 2}
