"""One member of a consumer group on JetStream: partition leases, pulls, deliveries.

A (group, pattern) has one durable pull consumer per partition. Members of the group split
the partitions between them: each member heartbeats on a core-NATS control subject, every
member computes the same assignment from the sorted member ids, and a member only pulls from
a partition whose lease (a KV entry created with compare-and-set, refreshed, expiring after
``lease_ttl``) it holds. A partition changes hands only after its previous owner settled
every message it held, so one key is never handled by two members at once and keys keep
publish order across members.

Within a member, each partition's received messages wait in a buffer sorted by stream
sequence. A message given back (``nack``/``release``) blocks its partition until its
redelivery comes back, so later messages of its key do not overtake it.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING

import orjson
from nats.errors import Error as NatsError
from nats.js.errors import APIError, KeyWrongLastSequenceError

from ..._logging import Throttled
from ...errors import BrokerError
from ...supervision import Component, ComponentState
from .config import consumer_name
from .delivery import (
    _EMPTY,
    _INTERNAL,
    _MAX_BLOCKED_BUFFER,
    _NAK,
    _PULL_LOST_AFTER,
    _WPI,
    KEY_HEADER,
    MSG_ID_HEADER,
    NatsDelivery,
    _Part,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription as NatsSub

    from .broker import NatsBroker

__all__ = ["KEY_HEADER", "MSG_ID_HEADER", "NatsDelivery", "NatsSubscription"]

_log = logging.getLogger("eventflow.nats")
_RETRY_MIN = 0.05
# What a coordination step may raise while the server restarts or the connection is down.
_TRANSIENT = (NatsError, BrokerError, OSError, TimeoutError)


class NatsSubscription:
    """A live member of one group on one pattern (see the module docstring)."""

    def __init__(self, broker: NatsBroker, pattern: str, group: str, gid: str) -> None:
        cfg = broker.config
        self.broker = broker
        self.pattern = pattern
        self.group = group
        self._gid = gid
        nc = broker._connection()
        self.nc = nc
        self.member_id = f"{uuid.uuid4().hex[:12]}"
        self.closed = False
        self.now = asyncio.get_running_loop().time
        self.await_guard = 2 * cfg.ack_wait
        self._inbox = nc.new_inbox()
        self._ctl_subject = f"{cfg.control_prefix}.{gid}"
        self._parts: dict[int, _Part] = {}
        self._members: dict[str, float] = {}
        self._others_draining: dict[str, set[int]] = {}
        self._ready = asyncio.Event()
        self._kick = asyncio.Event()
        self._rotate = 0
        self._prefix_len = len(cfg.prefix) + 1
        self._next_hb = 0.0
        self._next_keepalive = 0.0
        self._inbox_sub: NatsSub | None = None
        self._ctl_sub: NatsSub | None = None
        self._component: Component | None = None
        self._failures = 0  # coordination steps failed in a row
        self._log = Throttled(_log)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen, announce the member, claim its share of partitions (bounded wait)."""
        nc = self.nc
        self._inbox_sub = await nc.subscribe(f"{self._inbox}.*.*", cb=self._on_msg)
        self._ctl_sub = await nc.subscribe(self._ctl_subject, cb=self._on_ctl)
        await nc.flush()
        self._members[self.member_id] = self.now()
        await self._announce("join")
        supervisor = self.broker._supervisor
        if supervisor is None:
            raise BrokerError("NATS broker is not started: call `await broker.start()` first")
        self._component = supervisor.spawn(f"nats:{self.group}:{self.pattern}", self._coordinate)
        deadline = self.now() + self.broker.config.join_timeout
        while not self._joined() and self.now() < deadline:
            self._ready.clear()
            try:
                async with asyncio.timeout(0.02):
                    await self._ready.wait()
            except TimeoutError:
                pass

    def _joined(self) -> bool:
        draining = set().union(*self._others_draining.values()) if self._others_draining else set()
        return all(
            (p in self._parts and not self._parts[p].draining) or p in draining
            for p in self._desired()
        )

    async def close(self) -> None:
        """Leave the group: give back every held message in order, then the leases.

        Disconnected from the server, it leaves at once: ``ack_wait`` brings the held
        messages back and ``lease_ttl`` frees the partitions. Cancelled midway, it still
        stops the coordinator and its subscriptions, then lets the cancellation through."""
        if self.closed:
            return
        self.closed = True
        self._ready.set()
        component, self._component = self._component, None
        connected = self.nc.is_connected
        try:
            if component is not None and connected:
                # Let a running coordination step finish (a lease update cancelled midway
                # would leave us without the lease's revision), then stop.
                self._kick.set()
                try:
                    async with asyncio.timeout(2 * self.broker.config.request_timeout):
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
            self.broker._forget(self)

    async def _leave(self) -> None:
        try:
            await self._wait_pulls(list(self._parts.values()))
            for part in list(self._parts.values()):
                await self._give_back(part, everything=True)
            await self._release_leases(list(self._parts.values()))
            self._parts.clear()
            await self._announce("leave")
            await self.nc.flush(timeout=max(1, round(self.broker.config.request_timeout)))
        except Exception as exc:  # the server went away: ack_wait and lease_ttl take over
            _log.warning("%s: leaving group %s uncleanly: %s", self.pattern, self.group, exc)

    def kick(self) -> None:
        """Wake the coordinator (a delayed nack, a drained partition, a member change)."""
        self._kick.set()

    def on_reconnect(self) -> None:
        """Outstanding pull requests may have died with the connection: pull again."""
        for part in self._parts.values():
            part.pull_left = 0
            part.pull_until = 0.0
        self._ready.set()
        self._kick.set()

    # -- fetching ----------------------------------------------------------------------------

    async def fetch(self, max_messages: int, timeout: float) -> Sequence[NatsDelivery]:
        """Return 1..max_messages deliveries, or none after ``timeout`` seconds."""
        if self.closed:
            raise BrokerError("fetch on a closed subscription; subscribe again")
        self._check()
        out = self._take(max_messages)
        expires = min(max(timeout, 0.05), self.broker.config.pull_expires)
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
        for part in parts[self._rotate :] + parts[: self._rotate]:
            buf = part.buffer
            if part.draining or part.settling or not buf:
                continue
            awaiting, held = part.awaiting, part.out
            while buf and len(out) < limit:
                d = buf[0]
                if awaiting:
                    low = min(awaiting)
                    if d.seq > low:
                        if awaiting[low] < self.now():
                            del awaiting[low]  # never came back (max_deliver?): stop waiting
                            continue
                        break  # an earlier message of the partition is to be redelivered
                    awaiting.pop(d.seq, None)
                buf.popleft()
                held[d.seq] = d
                out.append(d)
            if len(out) >= limit:
                break
        return out

    async def _pull(self, want: int, expires: float) -> None:
        now = self.now()
        publish = self.nc.publish
        for part in list(self._parts.values()):
            if part.draining:
                continue
            if part.pull_left:
                if now <= part.pull_until:
                    # One request at a time per partition: its end (batch filled, or a
                    # status) then tells exactly when nothing more can arrive.
                    continue
                part.pull_left = 0  # it expired without a status (a reconnect lost it)
            if part.settling:
                if len(part.buffer) >= _MAX_BLOCKED_BUFFER:
                    continue
                need = want
            elif part.awaiting:
                if part.delayed or len(part.buffer) >= _MAX_BLOCKED_BUFFER:
                    continue  # nothing can be handed out before the delayed nack is due
                # Blocked until a given-back message returns: the server handles the nak
                # asynchronously, so a later message may have come first; pull on regardless.
                need = want
            else:
                need = want - len(part.buffer)
            if need <= 0:
                continue
            part.pull_id += 1
            part.pull_left = need
            # The server ends a request with a status at `expires`; only a lost connection
            # loses that, and the reconnect handler resets the count. The long fallback
            # keeps a late status from letting two requests overlap.
            part.pull_until = now + expires + _PULL_LOST_AFTER
            request = b'{"batch":%d,"expires":%d}' % (need, int(expires * 1e9))
            await publish(part.next_subject, request, reply=f"{part.inbox}.{part.pull_id}")

    async def _on_msg(self, msg: Msg) -> None:
        reply = msg.reply
        if not reply:  # a status: the pull request named in the subject ended (408, 409)
            _, index_text, pull_id = msg.subject.rsplit(".", 2)
            part = self._parts.get(int(index_text))
            if part is not None and int(pull_id) == part.pull_id:
                part.pull_left = 0
                if part.settling:
                    part.settling = False  # nothing (more) to redeliver
                    self._ready.set()
                if part.draining or self.closed:
                    self._kick.set()
            return
        subject = msg.subject
        rest = subject[self._prefix_len :]
        dot = rest.index(".")
        index = int(rest[:dot])
        tokens = reply.split(".")
        if len(tokens) == 9:
            consumer, count, seq, cseq = tokens[3], int(tokens[4]), int(tokens[5]), int(tokens[6])
        else:
            consumer, count, seq, cseq = tokens[5], int(tokens[6]), int(tokens[7]), int(tokens[8])
        part = self._parts.get(index)
        comp = 0
        if count > 1:
            comp = await self.broker._released(consumer, seq)
        if part is None or part.consumer != consumer:
            # A late answer to a pull for a partition no longer ours (we waited for our pull
            # requests to end, so only after a lost status): hand it back unseen.
            _log.warning("group %s: late message %d of %s given back", self.group, seq, consumer)
            await self.broker._record_release(consumer, seq, comp + 1)
            await self.nc.publish(reply, _NAK)
            return
        if part.pull_left:
            part.pull_left -= 1
        hdrs = msg.headers
        key: str | None = None
        headers = _EMPTY
        if hdrs:
            key = hdrs.get(KEY_HEADER)
            headers = {k: v for k, v in hdrs.items() if k not in _INTERNAL}
        d = NatsDelivery(
            self,
            part,
            reply,
            rest[dot + 1 :],
            msg.data,
            key,
            headers,
            seq,
            cseq,
            count - comp,
            comp,
        )
        part.insert(d)
        if count == 1:
            part.settling = False  # a first delivery: no redelivery is queued ahead of it
        self._ready.set()
        if part.draining or self.closed:
            self._kick.set()

    # -- coordination ------------------------------------------------------------------------

    def _desired(self) -> set[int]:
        members = sorted(self._members)
        me = members.index(self.member_id)
        n = len(members)
        return {p for p in range(self.broker.config.partitions) if p % n == me}

    async def _announce(self, op: str) -> None:
        draining = [p.index for p in self._parts.values() if p.draining]
        body = orjson.dumps({"id": self.member_id, "op": op, "draining": draining})
        await self.nc.publish(self._ctl_subject, body)

    async def _on_ctl(self, msg: Msg) -> None:
        try:
            data = orjson.loads(msg.data)
            member, op = str(data["id"]), str(data["op"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        if member == self.member_id:
            return
        if op == "leave":
            self._members.pop(member, None)
            self._others_draining.pop(member, None)
        else:
            known = member in self._members
            self._members[member] = self.now()
            self._others_draining[member] = set(data.get("draining") or ())
            if op == "join" or not known:
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
        cfg = self.broker.config
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
        cfg = self.broker.config
        nc = self.nc
        now = self.now()
        for part in self._parts.values():  # delayed nacks that are due
            for seq, (due, d) in list(part.delayed.items()):
                if due <= now:
                    del part.delayed[seq]
                    part.awaiting[seq] = now + self.await_guard
                    await nc.publish(d._reply, _NAK)
        # Forget members that stopped heartbeating (crashed): their partitions get reassigned
        # once their leases expire.
        stale = now - 3 * cfg.heartbeat_interval
        for member, seen in list(self._members.items()):
            if member != self.member_id and seen < stale:
                del self._members[member]
                self._others_draining.pop(member, None)
        self._members[self.member_id] = now
        desired = self._desired()
        changed = False
        for index, part in list(self._parts.items()):
            if index not in desired and not part.draining:
                part.draining = True
                changed = True
            if part.draining and not part.out and (not part.pull_left or now > part.pull_until):
                await self._give_back(part, everything=False)
                await self._release_leases([part])
                del self._parts[index]
                _log.debug(
                    "member %s of %s released partition %d", self.member_id, self.group, index
                )
                changed = True
        if now >= self._next_keepalive:
            # Refresh leases just before the in-progress heartbeats, so a lease always
            # outlives the ack timers of the messages it covers.
            self._next_keepalive = now + cfg.ack_wait / 3
            await self._refresh_leases()
            for part in self._parts.values():
                for d in part.held():
                    await nc.publish(d._reply, _WPI)
        missing = [p for p in desired if p not in self._parts]
        if missing:
            claimed = await asyncio.gather(*(self._claim(p) for p in missing))
            changed = changed or any(claimed)
        if changed or now >= self._next_hb:
            self._next_hb = now + cfg.heartbeat_interval
            await self._announce("hb")
        if changed:
            self._ready.set()

    async def _claim(self, index: int) -> bool:
        broker = self.broker
        key = f"{self._gid}.{index}"
        try:
            rev = await broker._leases().create(key, self.member_id.encode())
        except KeyWrongLastSequenceError:
            return False  # another member holds it; it lets go once it has settled
        part = _Part(index, consumer_name(self._gid, index), broker.config.stream, self._inbox, key)
        part.lease_rev = rev
        self._parts[index] = part
        _log.debug("member %s of %s claimed partition %d", self.member_id, self.group, index)
        return True

    async def _refresh_leases(self) -> None:
        kv = self.broker._leases()
        for index, part in list(self._parts.items()):
            try:
                part.lease_rev = await kv.update(
                    part.lease_key, self.member_id.encode(), last=part.lease_rev
                )
            except KeyWrongLastSequenceError:
                # Someone else took the partition (we stalled past lease_ttl): drop it at once
                # without giving messages back; they are redelivered when their ack timers end.
                _log.warning("group %s lost partition %d (lease expired)", self.group, index)
                del self._parts[index]

    async def _release_leases(self, parts: list[_Part]) -> None:
        kv = self.broker._leases()
        for part in parts:
            try:
                await kv.delete(part.lease_key, last=part.lease_rev)
            except (KeyWrongLastSequenceError, APIError) as exc:  # expired, maybe taken
                _log.debug("lease %s already gone: %s", part.lease_key, exc)
        if parts:
            self._kick.set()

    async def _wait_pulls(self, parts: list[_Part]) -> None:
        """Wait (bounded by the pull expiry) until no pull request can still deliver."""
        limit = self.now() + self.broker.config.pull_expires + 1.0
        while any(p.pull_left and self.now() <= p.pull_until for p in parts) and self.now() < limit:
            self._kick.clear()
            try:
                async with asyncio.timeout(0.05):
                    await self._kick.wait()
            except TimeoutError:
                pass

    async def _give_back(self, part: _Part, *, everything: bool) -> None:
        """Nak what the member holds for ``part`` in sequence order (so it is redelivered in
        order); messages no handler saw are recorded as released, so they are not counted."""
        items = (
            part.held()
            if everything
            else sorted([*part.buffer, *(d for _, d in part.delayed.values())], key=lambda d: d.seq)
        )
        unseen = [d for d in part.buffer]
        broker = self.broker
        await asyncio.gather(
            *(broker._record_release(part.consumer, d.seq, d._comp + 1) for d in unseen)
        )
        part.buffer.clear()
        part.delayed.clear()
        part.out.clear()
        for d in items:
            d._settled = True
        for d in items[:-1]:
            await self.nc.publish(d._reply, _NAK)
        if items:
            # The server handles acks apart from other requests: wait until it confirmed the
            # last nak (so all of them, in order) before the lease goes, or the next owner's
            # first pull could get a newer message ahead of the given-back ones.
            try:
                await self.nc.request(
                    items[-1]._reply, _NAK, timeout=self.broker.config.request_timeout
                )
            except NatsError as exc:
                _log.warning("group %s: nak not confirmed (%s); order may suffer", self.group, exc)
