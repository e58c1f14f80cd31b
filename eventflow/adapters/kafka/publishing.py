"""What a failed Kafka publish means for its caller: refused for good, maybe sent, or not
sent (no room in the producer's buffer, or the brokers away)."""

from __future__ import annotations

from aiokafka.errors import BrokerResponseError, KafkaError, KafkaTimeoutError

from ...errors import (
    BackpressureError,
    BrokerError,
    MessageRefusedError,
    PublishUnconfirmedError,
)

__all__ = ["publish_failure"]


def publish_failure(
    exc: KafkaError, topic: str, *, taken: bool, timeout: float
) -> BrokerError | BackpressureError:
    """The error a publish to ``topic`` that failed with ``exc`` raises, its cause set;
    ``taken`` says the producer had the record (so it may have sent it)."""
    if isinstance(exc, BrokerResponseError) and not exc.retriable:
        # The broker (or the producer, for a record over max_message_bytes) answered for
        # good: sending the same record again gets the same answer.
        error: BrokerError = MessageRefusedError(
            f"kafka refuses the message for {topic!r}: {exc!r}; it is not retried: make "
            "it smaller than max_message_bytes (and the topic's max.message.bytes) or "
            "check the client's permissions on the topic"
        )
    elif taken:  # the last try's error: an earlier one may have been stored
        error = PublishUnconfirmedError(
            f"kafka: publish to {topic!r} maybe sent: the brokers did not confirm it "
            f"within {timeout}s ({exc!r}), but the producer may have sent "
            "it, so it may still be delivered; publishing the same envelope again is "
            "safe: consumers drop a copy by its envelope id (Kafka has no duplicate "
            "window: a retry after a stored copy adds a second record)"
        )
    elif isinstance(exc, KafkaTimeoutError):
        pressure = BackpressureError(
            f"kafka: publishing to {topic!r} found no room in the producer's buffer "
            f"within {timeout}s, so it was not sent; the brokers are slow or unreachable"
        )
        pressure.__suppress_context__ = True  # as `raise ... from None`
        return pressure
    else:
        error = BrokerError(
            f"kafka: publishing to {topic!r} failed, not sent: {exc!r}; are the brokers up?"
        )
    error.__cause__ = exc
    return error
