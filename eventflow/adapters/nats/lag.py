"""A NATS group's lag (``NatsBroker.lag``): over the group's partition consumers, what
is not yet handled and when the server stored the oldest of it.

A partition consumer's ``num_pending`` counts the messages on its filter not yet delivered
and ``num_ack_pending`` those delivered and not acked (held by a member, live or dead, or
waiting for redelivery). Its ack floor is the stream sequence up to which every message on
its filter is acked, so the first message on the filter after the floor is the oldest one
not handled: its store time, read with a stream message get (``next_by_subj``), is the
partition's oldest. The get is asked only of partitions with something pending; the
partitions are asked concurrently, each with its info request, then its get.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from ...errors import BrokerError
from ...ports import Lag, PartitionLag
from .config import NatsBrokerConfig, consumer_name

__all__ = ["group_lag"]


async def group_lag(js: JetStreamContext, cfg: NatsBrokerConfig, gid: str, pattern: str) -> Lag:
    """The lag of the (group, pattern) ``gid`` on ``pattern``: the sum of its partition
    consumers' counts and the oldest of their oldest messages. A partition consumer that
    does not exist (nobody subscribed yet) counts nothing. Raises ``BrokerError`` when the
    server does not answer within ``request_timeout``."""
    parts = await asyncio.gather(
        *(_partition(js, cfg, gid, pattern, p) for p in range(cfg.partitions))
    )
    times = [oldest for _, oldest in parts if oldest is not None]
    return Lag(
        sum(count for count, _ in parts),
        min(times) if times else None,
        tuple(PartitionLag(str(p), count, oldest) for p, (count, oldest) in enumerate(parts)),
    )


async def _partition(
    js: JetStreamContext, cfg: NatsBrokerConfig, gid: str, pattern: str, partition: int
) -> tuple[int, datetime | None]:
    name = consumer_name(gid, partition)
    try:
        info = await js.consumer_info(cfg.stream, name, timeout=cfg.request_timeout)
    except NotFoundError:
        return 0, None
    except (NatsError, TimeoutError) as exc:
        raise _unanswered(cfg, f"consumer {name!r}", exc) from exc
    count = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    if count == 0:
        return 0, None
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    subject = f"{cfg.prefix}.{partition}.{pattern}"  # the consumer's filter (see admin)
    try:
        msg = await js.get_msg(cfg.stream, seq=floor + 1, subject=subject, next=True)
    except NotFoundError:
        # Nothing on the filter after the floor is in the stream any more (removed by its
        # limits, max_age or max_msgs, or deleted by hand): nothing to date.
        return count, None
    except (NatsError, TimeoutError) as exc:
        raise _unanswered(cfg, f"the oldest message on {subject!r}", exc) from exc
    stored = msg.time
    if stored is None:  # every server answer carries it; refuse to guess
        raise BrokerError(
            f"NATS returned message {msg.seq} of stream {cfg.stream!r} without its time"
        )
    return count, stored.astimezone(UTC)


def _unanswered(cfg: NatsBrokerConfig, what: str, exc: BaseException) -> BrokerError:
    return BrokerError(
        f"NATS did not tell the lag of {what} of stream {cfg.stream!r} "
        f"({type(exc).__name__}: {exc}); is the server up?"
    )
