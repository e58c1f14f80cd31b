"""One member of a consumer group on JetStream: joining, fetching, coordinating, leaving.

A (group, pattern) has one durable pull consumer per partition. Members split the
partitions between them (see :mod:`.membership`) and a member only pulls from a partition
whose lease it holds (see :mod:`.ledger`). A partition changes hands only after its
previous owner settled every message it held (see :mod:`.partition`), so one key is never
handled by two members at once and keys keep publish order across members.

The coordination loop (heartbeats, leases, delayed nacks, in-progress heartbeats) runs as a
component of the broker's supervisor. A step that fails on the server (it restarts, the
connection is down) is tried again with a growing pause, capped at ``heartbeat_interval``
so leases are refreshed as soon as the server is back, and logged at most once per interval;
any other error (a bug) ends the component, which the supervisor reports, and ``fetch``
then raises a ``BrokerError`` so the consumer subscribes again.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSub
from nats.errors import Error as NatsError

from ..._logging import Throttled
from ...errors import BrokerError
from ...supervision import Component, ComponentState, Supervisor
from .config import NatsBrokerConfig, consumer_name
from .delivery import NatsDelivery, parse_reply, split_headers
from .ledger import Leases, ReleaseLedger
from .membership import Membership
from .partition import NAK, Partition
from .waiting import Waiting

__all__ = ["NatsSubscription"]

_log = logging.getLogger("eventflow.nats")
_RETRY_MIN = 0.05
_STATUS = "Status"  # the header of a status message; an expired pull request's status:
_EXPIRED = "408"
# What a coordination step may raise while the server restarts or the connection is down.
_TRANSIENT = (NatsError, BrokerError, OSError, TimeoutError)


class NatsSubscription:
    """A live member of one group on one pattern (see the module docstring).

    The broker creates it with what it uses: the connection, the supervisor its coordinator
    runs under, the lease and release ledgers, and ``on_close`` (called with it once it
    left the group)."""

    def __init__(
        self,
        config: NatsBrokerConfig,
        nc: Client,
        *,
        pattern: str,
        group: str,
        gid: str,
        supervisor: Supervisor,
        leases: Leases,
        releases: ReleaseLedger,
        on_close: Callable[[NatsSubscription], None],
    ) -> None:
        self.config = config
        self.pattern = pattern
        self.group = group
        self._gid = gid
        self.nc = nc
        self._supervisor = supervisor
        self._leases = leases
        self._releases = releases
        self._on_close = on_close
        self.member_id = f"{uuid.uuid4().hex[:12]}"
        self._closed = False
        self.now = asyncio.get_running_loop().time
        self._inbox = nc.new_inbox()
        self._ctl_subject = f"{config.control_prefix}.{gid}"
        self._parts: dict[int, Partition] = {}
        self._membership = Membership(self.member_id, config.partitions, self.now())
        self._waiting = Waiting(group, pattern, config, leases, self._membership.alive)
        self._ready = asyncio.Event()
        self._kick = asyncio.Event()
        self._rotate = 0
        self._prefix_len = len(config.prefix) + 1
        self._next_hb = 0.0
        self._next_keepalive = 0.0
        self._inbox_sub: NatsSub | None = None
        self._ctl_sub: NatsSub | None = None
        self._component: Component | None = None
        self._failures = 0  # coordination steps failed in a row
        self._log = Throttled(_log)

    @property
    def closed(self) -> bool:
        """Whether this member left (or is leaving) its group."""
        return self._closed

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen, announce the member, claim its share of partitions (bounded wait)."""
        nc = self.nc
        self._inbox_sub = await nc.subscribe(f"{self._inbox}.*.*", cb=self._on_msg)
        self._ctl_sub = await nc.subscribe(self._ctl_subject, cb=self._on_ctl)
        await nc.flush()
        await self._announce("join")
        self._component = self._supervisor.spawn(
            f"nats:{self.group}:{self.pattern}", self._coordinate
        )
        deadline = self.now() + self.config.join_timeout
        while not self._joined() and self.now() < deadline:
            self._ready.clear()
            try:
                async with asyncio.timeout(0.02):
                    await self._ready.wait()
            except TimeoutError:
                pass

    def _joined(self) -> bool:
        held = [i for i, p in self._parts.items() if not p.draining]
        return self._membership.joined(held)

    async def close(self) -> None:
        """Leave the group: give back every held message in order, then the leases.

        Disconnected from the server, it leaves at once: ``ack_wait`` brings the held
        messages back and ``lease_ttl`` frees the partitions. Cancelled midway, it still
        stops the coordinator and its subscriptions, then lets the cancellation through."""
        if self.closed:
            return
        self._closed = True
        self._ready.set()
        component, self._component = self._component, None
        connected = self.nc.is_connected
        try:
            if component is not None and connected:
                # Let a running coordination step finish (a lease update cancelled midway
                # would leave us without the lease's revision), then stop.
                self._kick.set()
                try:
                    async with asyncio.timeout(2 * self.config.request_timeout):
                        await component.wait()
                except TimeoutError:
                    # Stuck past the bound: stop it before leaving, or a partition it claims
                    # after the leave would stay leased until lease_ttl.
                    await component.stop()
            if connected:
                await self._leave()
            else:
                _log.warning(
                    "%s: leaving group %s while disconnected from NATS: its messages come "
                    "back after ack_wait, its partitions after lease_ttl",
                    self.pattern,
                    self.group,
                )
        finally:
            if component is not None:
                await component.stop()
            for sub in (self._inbox_sub, self._ctl_sub):
                if sub is not None:
                    try:
                        await sub.unsubscribe()
                    except Exception as exc:  # connection already closed
                        _log.debug("unsubscribe failed: %s", exc)
            self._on_close(self)

    async def _leave(self) -> None:
        try:
            await self._wait_pulls(list(self._parts.values()))
            for part in list(self._parts.values()):
                await part.give_back(everything=True, timeout=self.config.request_timeout)
            await self._release_leases(list(self._parts.values()))
            self._parts.clear()
            await self._announce("leave")
            await self.nc.flush(timeout=max(1, round(self.config.request_timeout)))
        except Exception as exc:  # the server went away: ack_wait and lease_ttl take over
            _log.warning("%s: leaving group %s uncleanly: %s", self.pattern, self.group, exc)

    def kick(self) -> None:
        """Wake the coordinator (a delayed nack, a drained partition, a member change)."""
        self._kick.set()

    def wake(self) -> None:
        """Wake a waiting ``fetch`` (messages arrived or can be handed out again)."""
        self._ready.set()

    def on_reconnect(self) -> None:
        """Outstanding pull requests may have died with the connection: pull again."""
        for part in self._parts.values():
            part.pull_lost()
        self._ready.set()
        self._kick.set()

    # -- fetching ----------------------------------------------------------------------------

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[NatsDelivery]:
        """Return 1..max_messages deliveries, or none after ``timeout`` seconds."""
        if self.closed:
            raise BrokerError("fetch on a closed subscription; subscribe again")
        self._check()
        out = self._take(max_messages)
        expires = min(max(timeout, 0.05), self.config.pull_expires)
        if out or timeout <= 0:
            if not self.closed:
                await self._pull(max_messages, expires)
            return out
        deadline = self.now() + timeout
        while True:
            self._ready.clear()
            await self._pull(max_messages, expires)
            out = self._take(max_messages)
            remaining = deadline - self.now()
            if out or remaining <= 0 or self.closed:
                return out
            try:
                async with asyncio.timeout(remaining):
                    await self._ready.wait()
            except TimeoutError:
                return [] if self.closed else self._take(max_messages)
            self._check()

    def _check(self) -> None:
        """Raise ``BrokerError`` once the coordinator has failed: nothing keeps the leases."""
        component = self._component
        if component is not None and component.state is ComponentState.FAILED:
            raise BrokerError(
                f"group {self.group!r} on {self.pattern!r}: its NATS coordination failed "
                f"({type(component.last_error).__name__}: {component.last_error}); "
                "subscribe again"
            )

    def _take(self, limit: int) -> list[NatsDelivery]:
        out: list[NatsDelivery] = []
        parts = list(self._parts.values())
        if not parts:
            return out
        self._rotate = (self._rotate + 1) % len(parts)
        now = self.now()
        for part in parts[self._rotate :] + parts[: self._rotate]:
            part.take(out, limit, now)
            if len(out) >= limit:
                break
        return out

    async def _pull(self, want: int, expires: float) -> None:
        now = self.now()
        for part in list(self._parts.values()):
            await part.pull(want, expires, now)

    async def _on_msg(self, msg: Msg) -> None:
        reply = msg.reply
        if not reply:  # a status: the pull request named in the subject ended (408, 409)
            _, index_text, pull_id = msg.subject.rsplit(".", 2)
            part = self._parts.get(int(index_text))
            if part is not None:
                status = msg.headers.get(_STATUS) if msg.headers else None
                part.pull_ended(int(pull_id), expired=status == _EXPIRED)
            return
        index, _, topic = msg.subject[self._prefix_len :].partition(".")
        consumer, count, seq, cseq = parse_reply(reply)
        part = self._parts.get(int(index))
        released = 0
        if count > 1:
            released = await self._releases.count(consumer, seq)
        if part is None or part.consumer != consumer:
            # A late answer to a pull for a partition no longer ours (we waited for our pull
            # requests to end, so only after a lost status): hand it back unseen.
            _log.warning("group %s: late message %d of %s given back", self.group, seq, consumer)
            await self._releases.record(consumer, seq, released + 1)
            await self.nc.publish(reply, NAK)
            return
        key, headers = split_headers(msg.headers)
        d = NatsDelivery(
            part, reply, topic, msg.data, key, headers, seq, cseq, count - released, released
        )
        part.received(d, count)

    # -- coordination ------------------------------------------------------------------------

    async def _announce(self, op: str) -> None:
        draining = [p.index for p in self._parts.values() if p.draining]
        await self.nc.publish(self._ctl_subject, self._membership.announcement(op, draining))

    async def _on_ctl(self, msg: Msg) -> None:
        answer = self._membership.heard(msg.data, self.now())
        if answer is None:
            return
        if answer:
            self._next_hb = 0.0  # answer a newcomer at once
        self._kick.set()
        self._ready.set()

    async def _coordinate(self) -> None:
        """The supervised component: ``_run``, waking ``fetch`` when it ends."""
        try:
            await self._run()
        finally:
            self._ready.set()  # a fetch waiting now sees the component's state

    async def _run(self) -> None:
        cfg = self.config
        while not self.closed:
            try:
                await self._step()
            except _TRANSIENT as exc:  # the server may be restarting: try again soon
                self._failures += 1
                self._log.warning(
                    "coordination",
                    "group %s (%s): coordination failed (%s: %s); retrying",
                    self.group,
                    self.pattern,
                    type(exc).__name__,
                    exc,
                )
            else:
                if self._failures:
                    _log.info(
                        "group %s (%s): coordination works again after %d failed steps",
                        self.group,
                        self.pattern,
                        self._failures,
                    )
                    self._failures = 0
                    self._log.clear("coordination")
            now = self.now()
            wake = min(self._next_hb, self._next_keepalive, now + cfg.heartbeat_interval)
            wake = min(wake, self._waiting.retry_at)  # a dead member's lease expires
            for part in self._parts.values():
                if part.draining:
                    wake = min(wake, now + 0.05)
                for due, _ in part.delayed.values():
                    wake = min(wake, due)
            if self._failures:
                # Back off, but no further than a heartbeat: leases need refreshing as soon
                # as the server answers again.
                pause = _RETRY_MIN * 2 ** min(self._failures - 1, 16)
                wake = now + min(pause, cfg.heartbeat_interval)
            self._kick.clear()
            try:
                async with asyncio.timeout(max(0.0, wake - now)):
                    await self._kick.wait()
                    while self._failures and not self.closed:
                        self._kick.clear()  # a kick does not cut a backoff short; close does
                        await self._kick.wait()
            except TimeoutError:
                pass

    async def _step(self) -> None:
        cfg = self.config
        now = self.now()
        for part in self._parts.values():
            await part.nak_due(now)
        # Forget members that stopped heartbeating (crashed): their partitions get reassigned
        # once their leases expire.
        self._membership.beat(now, now - 3 * cfg.heartbeat_interval)
        desired = self._membership.desired()
        changed = False
        for index, part in list(self._parts.items()):
            if index not in desired and not part.draining:
                part.draining = True
                changed = True
            if part.draining and not part.out and not part.pulling(now):
                await part.give_back(everything=False, timeout=cfg.request_timeout)
                await self._release_leases([part])
                del self._parts[index]
                _log.debug(
                    "member %s of %s released partition %d", self.member_id, self.group, index
                )
                changed = True
        if now >= self._next_keepalive:
            # Refresh leases just before the in-progress heartbeats, so a lease always
            # outlives the ack timers of the messages it covers.
            self._next_keepalive = now + cfg.keepalive_interval
            await self._refresh_leases()
            for part in self._parts.values():
                await part.keep_alive()
        missing = [p for p in desired if p not in self._parts]
        claimed = await asyncio.gather(*(self._claim(p) for p in missing))
        got = [p for p, ok in zip(missing, claimed, strict=True) if ok]
        self._waiting.claimed(got)
        changed = changed or bool(got)
        # Held by another member: say once who holds them and when they move.
        held = {p: f"{self._gid}.{p}" for p, ok in zip(missing, claimed, strict=True) if not ok}
        await self._waiting.note(held, self.now())
        if changed or now >= self._next_hb:
            self._next_hb = now + cfg.heartbeat_interval
            await self._announce("hb")
        if changed:
            self._ready.set()

    async def _claim(self, index: int) -> bool:
        key = f"{self._gid}.{index}"
        sent = self.now()  # the lease lives lease_ttl from when the server stored it, later
        rev = await self._leases.claim(key, self.member_id)
        if rev is None:
            return False  # another member holds it; it lets go once it has settled
        cfg = self.config
        self._parts[index] = Partition(
            index,
            consumer_name(self._gid, index),
            cfg.stream,
            self._inbox,
            key,
            rev,
            sent + cfg.effective_lease_ttl,
            member=self,
            nc=self.nc,
            releases=self._releases,
            await_guard=2 * cfg.ack_wait,
            pull_guard=cfg.pull_guard,
        )
        _log.debug("member %s of %s claimed partition %d", self.member_id, self.group, index)
        return True

    async def _refresh_leases(self) -> None:
        until = self.now() + self.config.effective_lease_ttl  # from before the first refresh
        for index, part in list(self._parts.items()):
            rev = await self._leases.refresh(part.lease_key, self.member_id, part.lease_rev)
            if rev is None:
                # Someone else took the partition (we stalled past lease_ttl): drop it at once
                # without giving messages back; they are redelivered when their ack timers end.
                _log.warning("group %s lost partition %d (lease expired)", self.group, index)
                del self._parts[index]
            else:
                part.lease_rev, part.lease_until = rev, until
        self._ready.set()  # a pull held back for a fresh lease may go now

    async def _release_leases(self, parts: list[Partition]) -> None:
        for part in parts:
            await self._leases.release(part.lease_key, part.lease_rev)
        if parts:
            self._kick.set()

    async def _wait_pulls(self, parts: list[Partition]) -> None:
        """Wait (bounded by the pull expiry) until no pull request can still deliver."""
        limit = self.now() + self.config.pull_expires + 1.0
        while any(p.pulling(self.now()) for p in parts) and self.now() < limit:
            self._kick.clear()
            try:
                async with asyncio.timeout(0.05):
                    await self._kick.wait()
            except TimeoutError:
                pass
