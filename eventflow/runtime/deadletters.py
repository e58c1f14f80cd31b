"""``app.dead_letters``: inspect, replay and purge the dead letters of an app's groups."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import DeadLetterNotFound
from ..headers import SEND_ID_HEADER, TARGET_GROUP_HEADER
from ..ports import Broker, DeadLetter, DeadLetterStore
from .relay import RELAY_GROUPS

__all__ = ["DeadLetters"]


class DeadLetters:
    """The dead-letter queue of a set of groups, over a store and a broker.

    ``replay`` republishes each letter's original bytes to its topic with a header that
    targets only the group that failed, then deletes the letter. A message a relay parked
    (group ``eventflow:outbox`` or ``eventflow:event-relay``: the broker refused it) never
    reached any group, so its replay goes to every group of the topic.

    A replay is a deliberate re-send of an envelope the broker has seen: it goes with the
    letter's id as its send id (``eventflow-send-id``), so a broker's duplicate detection
    (JetStream's window) stores it as a new message while its envelope id, by which the
    group deduplicates, stays the original's. The letter is deleted only once the broker
    has accepted the copy; if the publish fails (even "maybe sent") it is kept, and replaying
    it again is safe: the same send id makes the broker drop a second copy within its
    window, and after it the group drops one by its envelope id once a copy is handled.
    """

    def __init__(
        self, store: DeadLetterStore, broker: Broker, groups: Iterable[str] | None = None
    ) -> None:
        self._store = store
        self._broker = broker
        self._groups = frozenset(groups) if groups is not None else None

    def _mine(self, letter: DeadLetter | None) -> bool:
        return letter is not None and (self._groups is None or letter.group in self._groups)

    async def list(self, *, group: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """Return up to ``limit`` dead letters, oldest first (optionally of one group)."""
        if group is not None and self._groups is not None and group not in self._groups:
            return []  # not one of this app's groups
        if group is not None or self._groups is None:
            return await self._store.list(group=group, limit=limit)
        letters: list[DeadLetter] = []
        for own in sorted(self._groups):
            letters.extend(await self._store.list(group=own, limit=limit))
        letters.sort(key=lambda d: d.failed_at)
        return letters[:limit]

    async def get(self, letter_id: str) -> DeadLetter:
        """Return one letter; raise ``DeadLetterNotFound`` if there is none with that id."""
        letter = await self._store.get(letter_id)
        if letter is None or not self._mine(letter):
            raise DeadLetterNotFound(
                f"no dead letter {letter_id!r}; run `eventflow dlq list` to see the ids"
            )
        return letter

    async def count(self) -> dict[str, int]:
        """Number of letters per group."""
        counts = await self._store.count()
        return {g: n for g, n in counts.items() if self._groups is None or g in self._groups}

    async def replay(self, letter_ids: Sequence[str]) -> int:
        """Republish the letters to their topics for their group only, deleting each once the
        broker accepted its copy; a publish that raises leaves that letter (and the ones
        after it) in place."""
        letters = [await self.get(i) for i in letter_ids]
        for letter in letters:
            headers = dict(letter.headers)
            headers[SEND_ID_HEADER] = letter.id
            if letter.group not in RELAY_GROUPS:
                headers[TARGET_GROUP_HEADER] = letter.group
            await self._broker.publish(
                letter.topic, letter.payload, key=letter.key, headers=headers
            )
            await self._store.remove([letter.id])
        return len(letters)

    async def purge(self, letter_ids: Sequence[str] | None = None) -> int:
        """Delete the given letters (all of this app's when None); return how many."""
        if letter_ids is None:
            ids = [d.id for d in await self.list(limit=1_000_000)]
        else:
            ids = [(await self.get(i)).id for i in letter_ids]
        return await self._store.remove(ids)
