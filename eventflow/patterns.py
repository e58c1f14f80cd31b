"""NATS-style topic patterns, used on every broker.

Topics are dot-separated tokens (``order.placed``). In a pattern, ``*`` matches exactly one
token and ``>`` (last token only) matches one or more remaining tokens.
"""

from __future__ import annotations

from functools import lru_cache

from .errors import ConfigurationError

__all__ = ["is_wildcard", "matches", "overlap", "validate_pattern", "validate_topic"]

_BLANKS = " \t\r\n"  # no broker takes them in a subject (NATS: a protocol line ends at CRLF)
_NOT_IN_TOPIC = "*>" + _BLANKS


def validate_topic(topic: str) -> str:
    """Return ``topic`` if it is a concrete topic name, else raise ``ConfigurationError``."""
    if (
        not topic
        or any(t == "" for t in topic.split("."))
        or any(c in topic for c in _NOT_IN_TOPIC)
    ):
        raise ConfigurationError(
            f"invalid topic {topic!r}: use dot-separated non-empty tokens without wildcards "
            "or whitespace"
        )
    return topic


def validate_pattern(pattern: str) -> str:
    """Return ``pattern`` if valid (``*`` whole tokens, ``>`` only last), else raise."""
    tokens = pattern.split(".") if pattern else [""]
    for i, tok in enumerate(tokens):
        bad = (
            tok == ""
            or any(c in tok for c in _BLANKS)
            or ("*" in tok and tok != "*")
            or (">" in tok and (tok != ">" or i != len(tokens) - 1))
        )
        if bad:
            raise ConfigurationError(
                f"invalid pattern {pattern!r}: tokens are separated by '.', '*' stands for "
                "one whole token and '>' only as the last token"
            )
    return pattern


def is_wildcard(pattern: str) -> bool:
    """True if ``pattern`` contains ``*`` or ``>``."""
    return "*" in pattern or ">" in pattern


@lru_cache(maxsize=4096)
def matches(pattern: str, topic: str) -> bool:
    """True if ``topic`` matches ``pattern``."""
    if pattern == topic:
        return True
    p = pattern.split(".")
    t = topic.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


def overlap(a: str, b: str) -> bool:
    """True if some topic matches both patterns."""
    pa, pb = a.split("."), b.split(".")
    for i in range(max(len(pa), len(pb))):
        x = pa[i] if i < len(pa) else None
        y = pb[i] if i < len(pb) else None
        if x == ">" or y == ">":
            return x is not None and y is not None
        if x is None or y is None:
            return False
        if x != "*" and y != "*" and x != y:
            return False
    return True
