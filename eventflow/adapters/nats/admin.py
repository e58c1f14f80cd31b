"""Creating or checking what the NATS broker needs on the server: the stream, the two KV
buckets (see :mod:`.ledger`) and a group's durable pull consumers, one per partition (a
group exists while they do; a new one begins at its ``start``).

Every check is one an app of another configuration would fail: a stream on other subjects
or with another partition count, a lease bucket with another TTL, a consumer on another
filter. Those raise ``ConfigurationError`` naming the setting and what to do; something
created concurrently by another app is taken as it is.

Upgrades: the lease bucket records its TTL in its stream's metadata. A lease bucket without
it was made by an older eventflow (whose default TTL was 37.5 s, for an ``ack_wait`` of
30 s): it is set to this broker's TTL, with a warning, instead of being refused. Consumers
made with an older ``ack_wait`` are updated when their group subscribes (see
:func:`ensure_consumer`).
"""

from __future__ import annotations

import logging
from typing import Any

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from ...errors import BrokerError, ConfigurationError
from ...ports import StartPosition
from .config import NatsBrokerConfig, consumer_name

__all__ = [
    "consumer_exists",
    "delete_consumers",
    "ensure_consumer",
    "ensure_kv",
    "ensure_stream",
]

_log = logging.getLogger("eventflow.nats")
_PARTITIONS_META = "eventflow.partitions"
_TTL_META = "eventflow.lease_ttl"


async def ensure_stream(js: JetStreamContext, cfg: NatsBrokerConfig) -> None:
    """Create the stream capturing ``<prefix>.>``, or check that the existing one does and
    was created with the same number of partitions."""
    subject = f"{cfg.prefix}.>"
    try:
        info = await js.stream_info(cfg.stream)
    except NotFoundError:
        stream = StreamConfig(
            name=cfg.stream,
            description="eventflow messages: <prefix>.<partition>.<topic>",
            subjects=[subject],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE if cfg.storage == "file" else StorageType.MEMORY,
            num_replicas=cfg.replicas,
            max_age=cfg.max_age,
            max_msgs=cfg.max_msgs,
            max_bytes=cfg.max_bytes,
            discard=DiscardPolicy.NEW,  # a full stream refuses publishes: none is dropped
            duplicate_window=cfg.duplicate_window,
            metadata={_PARTITIONS_META: str(cfg.partitions)},
        )
        try:
            info = await js.add_stream(stream)
        except APIError as exc:
            if "overlap" in str(exc):
                raise ConfigurationError(
                    f"cannot create NATS stream {cfg.stream!r} on {subject!r}: another "
                    "stream captures those subjects; choose another subject_prefix="
                ) from exc
            info = await js.stream_info(cfg.stream)  # created concurrently by another app
    subjects = info.config.subjects or []
    if subject not in subjects:
        raise ConfigurationError(
            f"NATS stream {cfg.stream!r} exists with subjects {subjects}, not {subject!r}; "
            "choose another stream= or subject_prefix= (or delete the stream)"
        )
    stored = (info.config.metadata or {}).get(_PARTITIONS_META)
    if stored is not None and int(stored) != cfg.partitions:
        raise ConfigurationError(
            f"NATS stream {cfg.stream!r} was created with {stored} partitions, this broker "
            f"uses {cfg.partitions}; every app must use the same partitions= (changing it "
            "needs a new stream)"
        )


async def ensure_kv(
    js: JetStreamContext, cfg: NatsBrokerConfig, bucket: str, ttl: float, *, strict: bool
) -> KeyValue:
    """Create KV ``bucket`` with entries expiring after ``ttl``, or open it; with ``strict``
    (the lease bucket) an existing bucket must have that TTL, every app agreeing on it, and
    one made by an older eventflow is set to it (see the module docstring)."""
    try:
        kv = await js.key_value(bucket)
    except BucketNotFoundError:
        storage = StorageType.FILE if cfg.storage == "file" else StorageType.MEMORY
        try:
            kv = await js.create_key_value(
                KeyValueConfig(
                    bucket=bucket,
                    history=1,
                    ttl=ttl,
                    storage=storage,
                    replicas=cfg.replicas,
                )
            )
        except APIError:
            kv = await js.key_value(bucket)
    if strict:
        await _check_ttl(js, kv, bucket, ttl)
    return kv


async def _check_ttl(js: JetStreamContext, kv: KeyValue, bucket: str, ttl: float) -> None:
    config = (await kv.status()).stream_info.config
    have = config.max_age or 0.0
    metadata = dict(config.metadata or {})
    if _TTL_META in metadata:
        if abs(have - ttl) > 0.01 * ttl:
            raise ConfigurationError(
                f"KV bucket {bucket!r} has a lease TTL of {have:g}s but this broker's is "
                f"{ttl:g}s; use the same ack_wait, pull_expires and lease_ttl in every app of "
                "the deployment (to change them, stop every app and delete the bucket)"
            )
        return
    # Made by this broker a moment ago (the metadata is written just below), or by an older
    # eventflow, which did not record its TTL: take it over with ours.
    config.max_age = ttl
    # The server refuses a duplicate window longer than the entries live.
    config.duplicate_window = min(config.duplicate_window or ttl, ttl)
    config.metadata = {**metadata, _TTL_META: f"{ttl:g}"}
    await js.update_stream(config)
    if abs(have - ttl) > 0.01 * ttl:
        _log.warning(
            "NATS KV bucket %s had the lease TTL of an older eventflow (%gs); set to %gs. "
            "Upgrade every app of the deployment: members of an older version refresh their "
            "leases too seldom for it and lose partitions now and then (their messages are "
            "redelivered, not lost, but may be handled twice or out of key order meanwhile)",
            bucket,
            have,
            ttl,
        )


async def consumer_exists(js: JetStreamContext, cfg: NatsBrokerConfig, name: str) -> bool:
    """Whether the stream has the consumer ``name``."""
    return await _consumer_info(js, cfg, name) is not None


async def delete_consumers(js: JetStreamContext, cfg: NatsBrokerConfig, gid: str) -> None:
    """Delete the partition consumers of the (group, pattern) ``gid`` (a temporary group
    whose member left); one already gone is fine. A failure is logged, not raised: the
    server removes them after their ``inactive_threshold`` anyway."""
    for partition in range(cfg.partitions):
        name = consumer_name(gid, partition)
        try:
            await js.delete_consumer(cfg.stream, name)
        except NotFoundError:
            pass
        except (NatsError, TimeoutError) as exc:
            _log.warning(
                "could not delete consumer %s of stream %s (%s); the server removes it "
                "once idle past its inactive_threshold",
                name,
                cfg.stream,
                exc,
            )
            return


async def _consumer_info(js: JetStreamContext, cfg: NatsBrokerConfig, name: str) -> Any:
    try:
        return await js.consumer_info(cfg.stream, name, timeout=cfg.request_timeout)
    except NotFoundError:
        return None
    except (NatsError, TimeoutError) as exc:
        raise BrokerError(
            f"NATS did not answer about consumer {name!r} of stream {cfg.stream!r} "
            f"({type(exc).__name__}: {exc}); is the server up?"
        ) from exc


async def ensure_consumer(
    js: JetStreamContext,
    cfg: NatsBrokerConfig,
    gid: str,
    partition: int,
    pattern: str,
    start: StartPosition = "latest",
) -> bool:
    """Create or update the durable pull consumer of group ``gid`` on ``partition``; True
    if this call created it. A new consumer begins at ``start`` (deliver policy ``new``:
    messages stored from now on, or ``all``: the oldest the stream keeps); an existing one
    keeps its position and its deliver policy (the server cannot change it). One that
    cannot be updated is used as it is (with a warning) unless it filters on other
    subjects."""
    name = consumer_name(gid, partition)
    subject = f"{cfg.prefix}.{partition}.{pattern}"
    info = await _consumer_info(js, cfg, name)
    if info is None:
        policy = DeliverPolicy.ALL if start == "earliest" else DeliverPolicy.NEW
        start_seq = start_time = None
    else:
        have = info.config
        policy, start_seq, start_time = have.deliver_policy, have.opt_start_seq, have.opt_start_time
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        description=f"eventflow group partition {partition} on {pattern}",
        deliver_policy=policy,
        opt_start_seq=start_seq,
        opt_start_time=start_time,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=cfg.ack_wait,
        max_deliver=cfg.max_deliver,
        max_ack_pending=cfg.max_ack_pending,
        filter_subject=subject,
        inactive_threshold=cfg.group_inactive_threshold,
    )
    try:
        # The server updates an existing consumer whose editable settings differ (such
        # as max_deliver), so a deployment upgraded to new settings gets them.
        await js.add_consumer(cfg.stream, config=config)
        return info is None
    except APIError as exc:
        error = exc
    # Refused: created meanwhile by another member or app with other settings, or one
    # whose settings the server cannot change.
    info = await _consumer_info(js, cfg, name)
    if info is None:
        raise BrokerError(f"cannot create NATS consumer {name!r}: {error}") from error
    if info.config.filter_subject != subject:
        raise ConfigurationError(
            f"NATS consumer {name!r} exists with filter {info.config.filter_subject!r}, "
            f"not {subject!r}; delete it (nats consumer rm {cfg.stream} {name})"
        )
    have = info.config.max_deliver
    if have is not None and have != cfg.max_deliver:
        _log.warning(
            "NATS consumer %s keeps max_deliver=%s and could not be updated to %s (%s): "
            "the server drops a message delivered that often without a trace; change it "
            "(nats consumer edit %s %s --max-deliver=%s) or delete the consumer",
            name,
            have,
            cfg.max_deliver,
            error,
            cfg.stream,
            name,
            cfg.max_deliver,
        )
        return False
    _log.warning("NATS consumer %s exists with other settings (%s); using it", name, error)
    return False
