"""The store contract's tests of the transactional parts: checkpoints, the outbox and the
transactional inbox (dedup) sharing one transaction (leases: see ``leases.py``), and the
capabilities a store declares (``durable``, ``supports_sql``, ``outbox.added``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from ...envelope import Envelope, new_id
from ...errors import AlreadyHandled, ConfigurationError
from ...ports import OutboxMessage, Store
from ..broker_contract import unique_name
from .support import Happened, StoreContractBase, StoreFactory

__all__ = ["TransactionContract"]


_WAKE_WITHIN = 0.5  # seconds; the relay's safety-net poll is 1 s


async def _look_until_found(store: Store, message_id: str) -> int:
    """What the outbox relay does: clear ``added``, look at ``pending``, wait on ``added``
    when nothing is there; return the seq of ``message_id`` once it is seen."""
    added = store.outbox.added
    while True:
        added.clear()
        for msg in await store.outbox.pending():
            if msg.message_id == message_id:
                return msg.seq
        await added.wait()


class TransactionContract(StoreContractBase):
    """Checkpoints, outbox and dedup in one transaction (all or nothing)."""

    # -- checkpoints -------------------------------------------------------------------------

    async def test_checkpoints_get_set_list_delete(self, store: Store) -> None:
        """Unknown names are at 0; set overwrites; list shows all; delete forgets."""
        cps = store.checkpoints
        a, b = unique_name("cp"), unique_name("cp")
        assert await cps.get(a) == 0
        await cps.set(a, 5)
        await cps.set(b, 2)
        assert await cps.get(a) == 5
        await cps.set(a, 9)
        assert await cps.get(a) == 9
        listed = await cps.list()
        assert {k: listed[k] for k in (a, b)} == {a: 9, b: 2}
        await cps.delete(a)
        assert await cps.get(a) == 0
        assert a not in await cps.list()
        assert await cps.get(b) == 2
        await cps.delete(unique_name("cp"))  # unknown: no error

    async def test_checkpoint_in_a_committed_transaction_is_set(self, store: Store) -> None:
        """A checkpoint written with ``tx`` is there once the block exits normally."""
        name = unique_name("cp")
        await store.checkpoints.set(name, 3)
        async with store.transaction() as tx:
            await store.checkpoints.set(name, 7, tx=tx)
        assert await store.checkpoints.get(name) == 7
        async with store.transaction() as tx:
            await store.checkpoints.delete(name, tx=tx)
        assert await store.checkpoints.get(name) == 0

    async def test_checkpoint_in_a_rolled_back_transaction_is_unchanged(self, store: Store) -> None:
        """An exception inside the block rolls back the checkpoint's set and delete."""
        name, fresh = unique_name("cp"), unique_name("cp")
        await store.checkpoints.set(name, 3)

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.checkpoints.set(name, 7, tx=tx)
                await store.checkpoints.set(fresh, 1, tx=tx)
                raise Boom
        assert await store.checkpoints.get(name) == 3
        assert await store.checkpoints.get(fresh) == 0
        assert fresh not in await store.checkpoints.list()

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.checkpoints.delete(name, tx=tx)
                raise Boom
        assert await store.checkpoints.get(name) == 3

        async with store.transaction() as tx:  # the store is usable after a rollback
            await store.checkpoints.set(name, 4, tx=tx)
        assert await store.checkpoints.get(name) == 4

    async def test_transactions_are_not_visible_before_commit(
        self, store_factory: StoreFactory
    ) -> None:
        """Until the block exits, another connection sees the old checkpoint."""
        store, other = await store_factory(), await store_factory()
        name = unique_name("cp")
        await store.checkpoints.set(name, 1)
        async with store.transaction() as tx:
            await store.checkpoints.set(name, 2, tx=tx)
            assert await other.checkpoints.get(name) == 1
        assert await other.checkpoints.get(name) == 2
        assert await store.checkpoints.get(name) == 2

    # -- outbox ------------------------------------------------------------------------------

    @staticmethod
    def _check_outbox(got: Sequence[OutboxMessage], sent: Sequence[tuple[str, Envelope]]) -> None:
        assert [(m.topic, m.message_id, m.key) for m in got] == [
            (topic, env.id, env.key) for topic, env in sent
        ]
        for message, (_, env) in zip(got, sent, strict=True):
            assert Envelope.from_bytes(message.payload).to_dict() == env.to_dict()
        seqs = [m.seq for m in got]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    async def test_outbox_add_pending_remove(self, store: Store) -> None:
        """Messages are pending in the order added (across adds), until removed."""
        topic = f"{unique_name()}.out"
        sent = [
            (topic, Envelope.create(Happened.event_type, {"n": i}, key=f"k{i % 2}"))
            for i in range(5)
        ]
        await store.outbox.add(sent[:2])
        async with store.transaction() as tx:
            await store.outbox.add(sent[2:4], tx=tx)
        await store.outbox.add(sent[4:])
        pending = await store.outbox.pending()
        self._check_outbox(pending, sent)
        self._check_outbox(await store.outbox.pending(limit=2), sent[:2])

        assert await store.outbox.backlog() == (5, pending[0])
        assert await store.outbox.backlog(limit=3) == (3, pending[0])
        await store.outbox.remove([pending[0].seq, pending[2].seq])
        assert await store.outbox.backlog() == (3, pending[1])
        self._check_outbox(await store.outbox.pending(), [sent[1], sent[3], sent[4]])
        await store.outbox.remove([m.seq for m in pending])
        assert await store.outbox.pending() == []
        assert await store.outbox.backlog() == (0, None)
        await store.outbox.remove([pending[0].seq])  # already gone: no error

    async def test_outbox_rollback_discards(self, store: Store) -> None:
        """Messages added in a rolled-back transaction never become pending."""
        topic = f"{unique_name()}.out"
        kept = (topic, Envelope.create(Happened.event_type, {"n": 1}))
        lost = (topic, Envelope.create(Happened.event_type, {"n": 2}))

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.outbox.add([lost], tx=tx)
                raise Boom
        assert await store.outbox.pending() == []
        async with store.transaction() as tx:
            await store.outbox.add([kept], tx=tx)
        self._check_outbox(await store.outbox.pending(), [kept])

    # -- transactional inbox (dedup) ---------------------------------------------------------

    async def test_mark_handled_counts_only_once_committed(
        self, store_factory: StoreFactory
    ) -> None:
        """``mark_handled`` in a transaction makes ``dedup.seen`` true only after commit,
        and never if the transaction rolls back."""
        store, other = await store_factory(), await store_factory()
        group, done, undone = unique_name("g"), new_id(), new_id()
        async with store.transaction() as tx:
            await store.mark_handled(group, done, tx)
            assert not await other.dedup.seen(group, done)
        assert await store.dedup.seen(group, done)
        assert await other.dedup.seen(group, done)
        assert not await store.dedup.seen(unique_name("g"), done)  # per group

        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.mark_handled(group, undone, tx)
                raise Boom
        assert not await store.dedup.seen(group, undone)
        assert not await other.dedup.seen(group, undone)

    async def test_one_transaction_commits_all_its_writes_together(self, store: Store) -> None:
        """Checkpoint, outbox message and dedup entry in one transaction: all or nothing."""
        name, group = unique_name("cp"), unique_name("g")
        topic = f"{unique_name()}.out"

        class Boom(Exception):
            pass

        first = Envelope.create(Happened.event_type, {"n": 1})
        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await store.checkpoints.set(name, 1, tx=tx)
                await store.outbox.add([(topic, first)], tx=tx)
                await store.mark_handled(group, first.id, tx)
                raise Boom
        assert await store.checkpoints.get(name) == 0
        assert await store.outbox.pending() == []
        assert not await store.dedup.seen(group, first.id)

        async with store.transaction() as tx:
            await store.checkpoints.set(name, 1, tx=tx)
            await store.outbox.add([(topic, first)], tx=tx)
            await store.mark_handled(group, first.id, tx)
        assert await store.checkpoints.get(name) == 1
        self._check_outbox(await store.outbox.pending(), [(topic, first)])
        assert await store.dedup.seen(group, first.id)

    async def test_mark_handled_records_a_cancellation(self, store_factory: StoreFactory) -> None:
        """``mark_handled(cancelled_by=...)`` records who cancelled the pair, visible to
        every store of the backend once committed; a plain entry has none; a recorded pair
        raises ``AlreadyHandled``, at the call or where its transaction ends (SQLite sends
        a transaction's writes with its commit), and nothing of that transaction commits
        (a pair recorded twice in one transaction too)."""
        store, other = await store_factory(), await store_factory()
        group, command, compensation = unique_name("g"), new_id(), new_id()
        async with store.transaction() as tx:
            await store.mark_handled(group, command, tx, cancelled_by=compensation)
            await store.mark_handled(group, compensation, tx)
        assert await other.dedup.seen(group, command)
        assert await other.dedup.cancelled_by(group, command) == compensation
        assert await other.dedup.cancelled_by(group, compensation) is None
        fresh, twice = new_id(), new_id()
        with pytest.raises(AlreadyHandled) as raised:
            async with store.transaction() as tx:
                await store.mark_handled(group, fresh, tx)
                await store.mark_handled(group, command, tx)
        assert raised.value.message_id == command
        with pytest.raises(AlreadyHandled):
            async with other.transaction() as tx:
                await other.mark_handled(group, twice, tx)
                await other.mark_handled(group, twice, tx)
        assert not await other.dedup.seen(group, fresh)  # rolled back with the duplicate
        assert not await store.dedup.seen(group, twice)
        assert await store.dedup.cancelled_by(group, command) == compensation

    async def test_of_two_transactions_recording_one_pair_only_one_commits(
        self, store_factory: StoreFactory
    ) -> None:
        """Of two open transactions recording one pair, one commits it and the other raises
        ``AlreadyHandled`` (PostgreSQL: the later waits for the first to end; SQLite: the
        later to commit raises), and when one rolls back the other records the pair: how a
        command handled at the same time as the compensation that cancels it loses, or
        wins."""
        store, other = await store_factory(), await store_factory()
        await self._race(store, other, first_commits=True)
        await self._race(store, other, first_commits=False)

    @staticmethod
    async def _race(store: Store, other: Store, *, first_commits: bool) -> None:
        group, message = unique_name("g"), new_id()
        marked, release = asyncio.Event(), asyncio.Event()

        class Boom(Exception):
            pass

        async def first() -> str:
            async with store.transaction() as tx:
                await store.mark_handled(group, message, tx, cancelled_by="first")
                marked.set()
                await release.wait()
                if not first_commits:
                    raise Boom
            return "first"

        async def second() -> str:
            await marked.wait()
            async with other.transaction() as tx:
                await other.mark_handled(group, message, tx, cancelled_by="second")
            return "second"

        holder = asyncio.create_task(first())
        contender = asyncio.create_task(second())
        try:
            await marked.wait()
            await asyncio.sleep(0.05)  # the contender runs (or waits) meanwhile
            release.set()
            outcomes = await asyncio.gather(holder, contender, return_exceptions=True)
            if first_commits:
                won = [o for o in outcomes if isinstance(o, str)]
                lost = [o for o in outcomes if isinstance(o, AlreadyHandled)]
                assert len(won) == 1 and len(lost) == 1, outcomes
                assert await other.dedup.cancelled_by(group, message) == won[0]
                assert await store.dedup.cancelled_by(group, message) == won[0]
            else:
                assert isinstance(outcomes[0], Boom), outcomes
                assert outcomes[1] == "second", outcomes
                assert await store.dedup.cancelled_by(group, message) == "second"
        finally:
            release.set()
            for task in (holder, contender):
                task.cancel()
            await asyncio.gather(holder, contender, return_exceptions=True)

    # -- declared capabilities ---------------------------------------------------------------

    async def test_supports_sql_says_whether_transactions_run_sql(self, store: Store) -> None:
        """With ``supports_sql`` a table written in a transaction commits and rolls back with
        it; without, ``execute`` and ``fetch`` refuse with ``ConfigurationError``."""
        assert isinstance(store.supports_sql, bool)
        table = unique_name("t")
        if not store.supports_sql:
            async with store.transaction() as tx:
                with pytest.raises(ConfigurationError):
                    await tx.execute(f"CREATE TABLE {table} (n INTEGER)")
                with pytest.raises(ConfigurationError):
                    await tx.fetch("SELECT 1")
            return

        class Boom(Exception):
            pass

        async with store.transaction() as tx:
            await tx.execute(f"CREATE TABLE {table} (n INTEGER)")
            await tx.execute(f"INSERT INTO {table} (n) VALUES ($1)", 1)
        with pytest.raises(Boom):
            async with store.transaction() as tx:
                await tx.execute(f"INSERT INTO {table} (n) VALUES ($1)", 2)
                raise Boom
        async with store.transaction() as tx:
            assert await tx.fetch(f"SELECT n FROM {table} ORDER BY n") == [(1,)]

    async def test_a_durable_store_is_seen_by_another_connection(
        self, store_factory: StoreFactory
    ) -> None:
        """A ``durable`` store's events are there for another store opened on the same
        backend (another process); a store that is not durable still says so with a bool."""
        store = await store_factory()
        assert isinstance(store.durable, bool)
        if not store.durable:
            return
        stream = unique_name("s")
        await store.append(stream, [Happened(n=1)])
        other = await store_factory()
        assert other is not store
        assert await other.stream_version(stream) == 1

    async def test_outbox_added_is_set_by_an_add(self, store: Store) -> None:
        """``outbox.added`` is set once an add returns (outside a transaction) or once its
        transaction committed, so the relay sends it without waiting for its poll."""
        added = store.outbox.added
        topic = f"{unique_name()}.out"
        added.clear()
        await store.outbox.add([(topic, Envelope.create(Happened.event_type, {"n": 1}))])
        assert added.is_set()
        added.clear()
        async with store.transaction() as tx:
            await store.outbox.add([(topic, Envelope.create(Happened.event_type, {"n": 2}))], tx=tx)
        assert added.is_set()

    async def test_outbox_added_is_set_by_another_stores_add(
        self, store_factory: StoreFactory
    ) -> None:
        """A durable store's ``outbox.added`` is set by an add that another store on the same
        backend (another process) commits, within milliseconds: a relay waiting on it, as
        the outbox relay does, sends what other instances write without waiting for its
        poll. (A store that is not durable is one process: the test above is its case.)"""
        store = await store_factory()
        if not store.durable:
            return
        other = await store_factory()
        env = Envelope.create(Happened.event_type, {"n": 1})
        relay = asyncio.ensure_future(_look_until_found(store, env.id))
        try:
            await asyncio.sleep(0.1)  # the relay is idle, past its first checks (SQLite)
            assert not relay.done()
            async with other.transaction() as tx:
                await other.outbox.add([(f"{unique_name()}.out", env)], tx=tx)
            async with asyncio.timeout(_WAKE_WITHIN):
                seq = await relay
        finally:
            relay.cancel()
        await store.outbox.remove([seq])
