"""``wait_idle``: wait until an app has nothing left to do with what was published so far.

An app is **idle** when, in one look, all of these hold:

- for every subscription of the app (each ``(group, pattern)`` of its handlers and sagas),
  the broker reports a lag of zero messages (``Broker.lag``: nothing undelivered, nothing
  delivered and not yet acked, across every member of the group);
- no consumer of the app has a delivery in flight (fetched and not yet settled);
- the store's outbox has no pending row (``Outbox.backlog``: nothing committed by a handler's
  ``ctx.transaction()`` still waits for the relay);
- every projection of the app has handled the store's last position;

and two such looks in a row find it so with no handling started or finished by the app in
between (its consumers' counters unchanged from the start of the first look to the end of the
second). The looks are ordered along the path a message takes (outbox, then broker lag, then
the counters), and the counters catch a handler that published while a look was under way, so
a chain of hops (a handler publishing, directly or through the outbox, to another group of
the app) is idle only once its last hop was handled or dead-lettered.

What it does not wait for: saga timers and step deadlines not yet due, retries waiting out
their backoff count as lag (they are not acked) and so are waited for; messages published to
topics no subscription of this app reads; the event relay (``relay_events=True``) of events
appended outside a handler. Kafka counts an acked message until the member's next commit
(``commit_interval``), so idleness shows up that much later there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from ..errors import ConfigurationError, IdleTimeoutError
from ..ports import Outbox, Store, declared
from .consumer import Consumer

__all__ = ["DEFAULT_IDLE_TIMEOUT", "busy_lines", "wait_idle"]

DEFAULT_IDLE_TIMEOUT = 10.0
"""Seconds ``app.wait_idle()`` waits by default."""
_INTERVAL = 0.01  # between looks: short, as tests wait on it
_INTERVAL_MAX = 0.1
_OUTBOX_CAP = 1000


def _activity(consumers: Sequence[Consumer]) -> tuple[tuple[int, ...], ...]:
    """Every counter of every consumer: any handling started or settled changes it."""
    return tuple(tuple(c.stats.as_dict().values()) for c in consumers)


async def busy_lines(
    consumers: Sequence[Consumer], store: Store, projections: Sequence[str]
) -> list[str]:
    """What is still busy, one line each (empty: nothing), looked at in a message's order:
    the outbox, then each subscription's broker lag and in-flight deliveries, then the
    projections. A broker or store that cannot answer counts as busy, saying why."""
    lines: list[str] = []
    try:
        backlog = declared(store.outbox, Outbox, "backlog")
        rows, _ = await backlog(limit=_OUTBOX_CAP)
    except Exception as exc:
        lines.append(f"outbox: cannot be read ({type(exc).__name__}: {exc})")
    else:
        if rows:
            more = "+" if rows >= _OUTBOX_CAP else ""
            lines.append(f"outbox: {rows}{more} rows not yet relayed to the broker")
    for consumer in consumers:
        try:
            lag = await consumer.lag()
        except Exception as exc:
            lines.append(
                f"group {consumer.group!r} on {consumer.spec.pattern!r}: lag unknown "
                f"({type(exc).__name__}: {exc})"
            )
            continue
        inflight = consumer.inflight
        if lag.messages or inflight:
            lines.append(
                f"group {consumer.group!r} on {consumer.spec.pattern!r}: lag {lag.messages} "
                f"message(s), {inflight} in flight"
            )
    if projections:
        try:
            end = await store.last_position()
            for name in projections:
                done = await store.checkpoints.get(name)
                if done < end:
                    lines.append(f"projection {name!r}: {end - done} event(s) behind")
        except Exception as exc:
            lines.append(f"projections: cannot be read ({type(exc).__name__}: {exc})")
    return lines


async def wait_idle(
    consumers: Sequence[Consumer],
    store: Store,
    projections: Sequence[str],
    *,
    timeout: float,
    check: Callable[[], None] = lambda: None,
    name: str = "app",
) -> None:
    """Return once the app is idle (see the module docstring); raise ``IdleTimeoutError``
    naming what is still busy after ``timeout`` seconds. ``check()`` is called before each
    look and may raise (the app stopped or failed)."""
    if not timeout > 0:
        raise ConfigurationError(f"timeout must be a number of seconds above 0, got {timeout!r}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    interval = _INTERVAL
    clean_from: tuple[tuple[int, ...], ...] | None = None  # counters when a clean look began
    while True:
        check()
        before = _activity(consumers)
        busy = await busy_lines(consumers, store, projections)
        after = _activity(consumers)
        if busy or before != after:
            clean_from = None
        elif clean_from == before:  # two clean looks, nothing handled since the first began
            return
        else:
            clean_from = before
            interval = _INTERVAL  # look again soon: one more clean look ends the wait
        now = loop.time()
        if now >= deadline:
            lines = tuple(busy) or ("handlings kept starting or ending between two looks",)
            raise IdleTimeoutError(
                f"{name} not idle after {timeout:g}s: " + "; ".join(lines) + ". A handler "
                "that never returns, a message retried with a long backoff, or a chain of "
                "messages that does not end keeps an app busy; raise the timeout if the work "
                "is just slow",
                lines,
            )
        await asyncio.sleep(min(interval, deadline - now))
        if clean_from is None:
            interval = min(interval * 2, _INTERVAL_MAX)
