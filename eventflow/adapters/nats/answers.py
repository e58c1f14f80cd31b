"""What JetStream's answers to a publish mean: the errors ``NatsBroker.publish`` raises.

A publish ends in one of: stored (an ack), refused for good (``MessageRefusedError``: too
large, a 4xx JetStream error), a full stream (retried, then ``BackpressureError``), maybe
sent (``PublishUnconfirmedError``: a request timed out, so a copy may have been stored) or
not sent (``BrokerError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ...errors import BrokerError, MessageRefusedError, PublishUnconfirmedError
from ...headers import MESSAGE_ID_HEADER, SEND_ID_HEADER
from .config import NatsBrokerConfig

__all__ = ["publish_error", "too_large", "unsent"]


def unsent(
    config: NatsBrokerConfig, topic: str, why: str, hdrs: Mapping[str, str], maybe: bool
) -> BrokerError:
    """The error of a publish that failed: ``PublishUnconfirmedError`` if an attempt may
    have been stored (``maybe``), else a ``BrokerError`` saying it was not sent."""
    if not maybe:
        return BrokerError(
            f"publish to {topic!r} not sent: {why}; nothing was stored: is the server up, "
            "with JetStream? Publish it again once it is"
        )
    if MESSAGE_ID_HEADER in hdrs or SEND_ID_HEADER in hdrs:
        retry = (
            "publishing the same envelope again is safe: JetStream drops a copy with its "
            f"id within the stream's duplicate window ({config.duplicate_window:g}s) "
            "and consumers drop one by its envelope id"
        )
    else:
        retry = "it has no eventflow-id header, so sending it again may store a second copy"
    return PublishUnconfirmedError(
        f"publish to {topic!r} maybe sent: {why}, but an attempt may have been stored (a "
        "request timed out; while the server is away the client sends what it buffered "
        f"once it reconnects), so it may still be delivered; {retry}"
    )


def too_large(topic: str, size: int, limit: int) -> str:
    """Why a message over the server's ``max_payload`` is refused."""
    return (
        f"NATS refuses the message for {topic!r}: {size} bytes with its headers, over the "
        f"server's max_payload of {limit} bytes; it is not retried: make the message "
        "smaller (or store the data elsewhere and send a reference), or raise max_payload "
        "in the server's configuration"
    )


def publish_error(config: NatsBrokerConfig, data: bytes, topic: str) -> str:
    """The problem JetStream's error reply names, if it may pass (retried until the
    deadline); raise ``MessageRefusedError`` for a refusal that will not."""
    try:
        error: dict[str, Any] = orjson.loads(data)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return data.decode(errors="replace")
    text = str(error.get("description", error))
    code = error.get("code")
    if (
        code == 503
        or "maximum messages" in text
        or "maximum bytes" in text
        or "insufficient resources" in text
    ):
        return text  # stream full, or the server not ready: retried until the deadline
    if isinstance(code, int) and 400 <= code < 500:
        raise MessageRefusedError(
            f"JetStream refused a message for {topic!r} for good: {text} (error "
            f"{error.get('err_code', code)}); it is not retried: fix the message, or the "
            f"limits of stream {config.stream!r} (max_msg_size)"
        )
    raise BrokerError(
        f"JetStream could not store a message for {topic!r}: {text}; this may pass, "
        "publish it again later"
    )
