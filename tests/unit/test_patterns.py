"""NATS-style topic patterns: validation, matching and overlap."""

import itertools

import pytest

from eventflow import ConfigurationError
from eventflow.patterns import is_wildcard, matches, overlap, validate_pattern, validate_topic


@pytest.mark.parametrize("topic", ["order", "order.placed", "a.b.c.d", "order-1.v_2", "ü.x"])
def test_valid_topics(topic: str) -> None:
    assert validate_topic(topic) == topic


@pytest.mark.parametrize(
    "topic",
    ["", ".", "order.", ".order", "a..b", "order.*", "order.>", "a b", "a\tb", "a\nb", "a\rb"],
)
def test_invalid_topics(topic: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid topic"):
        validate_topic(topic)


@pytest.mark.parametrize("pattern", ["order", "order.*", "order.>", "*", ">", "*.placed", "a.*.>"])
def test_valid_patterns(pattern: str) -> None:
    assert validate_pattern(pattern) == pattern


@pytest.mark.parametrize(
    "pattern",
    ["", "a..b", "a.", ".a", "a.*b", "a.b*", "a.>.b", ">.a", "a.>>", "a b", "a.x>", "a\rb"],
)
def test_invalid_patterns(pattern: str) -> None:
    with pytest.raises(ConfigurationError, match="invalid pattern"):
        validate_pattern(pattern)


def test_is_wildcard() -> None:
    assert is_wildcard("order.*")
    assert is_wildcard("order.>")
    assert not is_wildcard("order.placed")


@pytest.mark.parametrize(
    ("pattern", "topic", "expected"),
    [
        ("order.placed", "order.placed", True),
        ("order.placed", "order.shipped", False),
        ("order.placed", "order.placed.v2", False),
        ("order.*", "order.placed", True),
        ("order.*", "order", False),
        ("order.*", "order.placed.v2", False),
        ("*.placed", "order.placed", True),
        ("*.placed", "order.shipped", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.b.d", False),
        ("order.>", "order.placed", True),
        ("order.>", "order.placed.v2", True),
        ("order.>", "order", False),
        ("order.>", "orders.placed", False),
        (">", "a", True),
        (">", "a.b.c", True),
        ("*", "a", True),
        ("*", "a.b", False),
        ("a.*.>", "a.b.c", True),
        ("a.*.>", "a.b", False),
    ],
)
def test_matches(pattern: str, topic: str, expected: bool) -> None:
    assert matches(pattern, topic) is expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("order.placed", "order.placed", True),
        ("order.placed", "order.shipped", False),
        ("order.*", "order.placed", True),
        ("order.*", "order.>", True),
        ("order.*", "*.placed", True),
        ("order.>", "order", False),
        ("a.>", "b.>", False),
        ("a.*", "a.*.c", False),
        (">", "a.b", True),
        ("a.*.>", "a.b", False),
        ("*.*", "a.>", True),
    ],
)
def test_overlap(a: str, b: str, expected: bool) -> None:
    assert overlap(a, b) is expected
    assert overlap(b, a) is expected


PATTERNS = [
    "a",
    "b",
    "a.b",
    "*",
    ">",
    "a.*",
    "*.b",
    "a.>",
    "*.>",
    "a.b.c",
    "a.*.c",
    "*.*",
    "*.*.*",
    "a.b.>",
    "b.*.>",
]
TOPICS = [
    ".".join(tokens) for n in range(1, 5) for tokens in itertools.product(["a", "b", "c"], repeat=n)
]


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations_with_replacement(PATTERNS, 2)))
def test_overlap_agrees_with_matching_some_topic(a: str, b: str) -> None:
    # Patterns here have at most 3 tokens, so topics of up to 4 tokens are a complete witness set.
    witness = any(matches(a, t) and matches(b, t) for t in TOPICS)
    assert overlap(a, b) is witness
