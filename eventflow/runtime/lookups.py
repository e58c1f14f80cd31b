"""Dedup lookups for a whole fetched batch: one ``DedupStore.seen_many`` query instead of a
``seen`` per message.

The dispatcher hands each fetched batch (of two or more) to ``Lookups.fetched`` before
filing it; the ids are the broker header ``eventflow-id`` that eventflow sets on every send
(a delivery without it, from a foreign producer, is checked on its own). The pipeline then
``take``\\ s its verdict instead of asking the store:

- "seen" is final: a record is never removed (but by the retention), so the copy is skipped;
- "not seen" holds only ``FRESH`` seconds after the lookup began, and only until this
  pipeline records the id itself (``forget``: a copy handled meanwhile, found by a lookup
  that was under way then too), so a record written meanwhile elsewhere (a compensation
  cancelling the command, a copy handled by another member) is missed for at most that
  long, as one written while a handler runs is missed today. Under a backlog of slow
  handlers the verdicts expire and each message is checked on its own, where the check
  costs little beside its handler;
- a verdict is taken once: a second copy in the batch is checked on its own (after the
  first copy's outcome, which the pipeline waits for).

A lookup that fails leaves no verdicts: each message is then checked on its own, where a
failure is one around the handler (given back, paused).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from .._logging import Throttled
from ..headers import MESSAGE_ID_HEADER
from ..ports import DedupStore, Delivery, declared

__all__ = ["FRESH", "Lookups"]

FRESH = 0.25
"""Seconds a "not seen" verdict of a batch lookup stands in for the check at the handling."""

_log = Throttled(logging.getLogger("eventflow.consumer"))


class Lookups:
    """The batch dedup verdicts of one subscription's pipeline (one group)."""

    def __init__(
        self, group: str, name: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.group = group
        self.name = name
        self._clock = clock
        # id -> (seen, monotonic time its lookup began); at most a fetch window of them.
        self._verdicts: dict[str, tuple[bool, float]] = {}
        self._looking: set[str] | None = None  # the ids of the lookup under way

    async def fetched(self, dedup: DedupStore, deliveries: Sequence[Delivery]) -> None:
        """Look up the ids of a fetched batch at once and keep the verdicts."""
        ids: list[str] = []
        for delivery in deliveries:
            headers = delivery.headers
            env_id = headers.get(MESSAGE_ID_HEADER) if headers else None
            if env_id:
                ids.append(env_id)
        began = self._clock()
        verdicts = self._verdicts
        if verdicts:  # drop the expired and the never taken (a delivery skipped early)
            self._verdicts = verdicts = {
                k: v for k, v in verdicts.items() if v[0] or began - v[1] < FRESH
            }
        if len(ids) < 2:
            return
        looking = self._looking = set(ids)
        try:
            seen = await declared(dedup, DedupStore, "seen_many")(self.group, ids)
        except Exception as exc:
            _log.warning(
                f"lookups:{self.name}",
                "%s: the dedup lookup of a fetched batch failed (%s: %s); checking each "
                "message on its own",
                self.name,
                type(exc).__name__,
                exc,
            )
            return
        finally:
            self._looking = None
        for env_id in looking:  # without the ids this pipeline recorded meanwhile
            verdicts[env_id] = (env_id in seen, began)

    def take(self, env_id: str) -> bool | None:
        """The batch verdict for ``env_id`` (True: seen), once; None: check it on its own."""
        verdict = self._verdicts.pop(env_id, None)
        if verdict is None:
            return None
        seen, began = verdict
        if seen or self._clock() - began < FRESH:
            return seen
        return None

    def forget(self, env_id: str) -> None:
        """This pipeline recorded ``env_id`` (handled it): a verdict of "not seen" for it,
        kept or being looked up, no longer holds."""
        self._verdicts.pop(env_id, None)
        looking = self._looking
        if looking is not None:
            looking.discard(env_id)
