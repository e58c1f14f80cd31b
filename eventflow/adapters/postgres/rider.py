"""Writes that ride on an append: rows of other tables written by the append's own
statement, and only if every event went in.

A :class:`Rider` is one data-modifying statement (``INSERT``, ``UPDATE`` or ``DELETE``,
without a ``WITH`` of its own) with its own ``$1, $2, ...`` parameters and the marker
:data:`APPENDED` where its condition goes (``... WHERE {appended}``, ``... AND
{appended}``). :func:`riding` puts the riders into the append as data-modifying ``WITH``
queries after the insert of the events, each guarded on the insert having taken every
event (``ok``), their parameters numbered after the append's: one round trip for the
events and the rows. :func:`alone` is the same riders in a statement of their own
(guard ``true``), for an append that took the slow path and succeeded there.

A rider may insert without ``ON CONFLICT`` where a row committed first means the whole
write is refused (a dedup entry: a copy handled first): its ``conflict`` names the unique
constraint and the error to raise; the statement then fails whole, nothing of it written,
and :func:`refusing` raises that error for the driver's. Its ``written`` is called once the
statement that carried it went in (the transaction still open).

PostgreSQL runs every data-modifying ``WITH`` query to completion whether or not anything
reads it, against one snapshot: two riders of one statement must not touch the same row
(the saga tables' upserts and deletes never do). The texts are cached, so asyncpg's
prepared-statement cache serves every append after the first of each shape.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg

__all__ = ["APPENDED", "Rider", "alone", "arguments", "refusing", "riding"]

APPENDED = "{appended}"
"""Where a rider's statement takes the append's outcome: true once every event went in."""

_PARAM = re.compile(r"\$(\d+)")
_GUARD = "(SELECT ok FROM ok)"
_cache: dict[tuple[str, int, tuple[tuple[str, int], ...]], str] = {}


@dataclass(frozen=True)
class Rider:
    """One statement to write with an append (see the module docstring). ``committed``:
    called once the transaction that wrote it commits (a wake-up, say); ``written``: once
    its statement went in; ``conflict``: (a unique constraint, the error a violation of it
    stands for), for an insert without ``ON CONFLICT``."""

    sql: str
    args: tuple[Any, ...]
    committed: Callable[[], None] | None = None
    written: Callable[[], None] | None = None
    conflict: tuple[str, Callable[[], Exception]] | None = None


def _shapes(riders: Sequence[Rider]) -> tuple[tuple[str, int], ...]:
    return tuple((r.sql, len(r.args)) for r in riders)


def _shifted(offset: int) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement moving a ``$N`` parameter to ``$(N + offset)``."""
    return lambda m: f"${int(m.group(1)) + offset}"


def _numbered(shapes: tuple[tuple[str, int], ...], offset: int, guard: str) -> list[str]:
    """Each rider's statement with its parameters moved past ``offset`` (and past the
    riders before it) and its marker replaced by ``guard``, as ``rN AS (...)``."""
    out = []
    for n, (sql, count) in enumerate(shapes):
        if APPENDED not in sql:
            raise ValueError(f"a rider's statement has no {APPENDED} condition: {sql!r}")
        moved = _PARAM.sub(_shifted(offset), sql)
        out.append(f"r{n} AS ({moved.replace(APPENDED, guard)})")
        offset += count
    return out


def riding(append_sql: str, append_args: int, riders: Sequence[Rider]) -> str:
    """The append ``append_sql`` (an ``INSERT ... RETURNING`` of ``append_args``
    parameters, the event ids in ``$2``) with ``riders`` in its statement; it returns what
    the append returns. Without riders, the append as it is."""
    if not riders:
        return append_sql
    key = (append_sql, append_args, _shapes(riders))
    sql = _cache.get(key)
    if sql is None:
        parts = [
            f"ins AS ({append_sql})",
            "ok AS (SELECT count(*) = cardinality($2::text[]) AS ok FROM ins)",
            *_numbered(key[2], append_args, _GUARD),
        ]
        sql = _cache[key] = f"WITH {', '.join(parts)} SELECT * FROM ins"
    return sql


def alone(riders: Sequence[Rider]) -> str:
    """The riders in one statement of their own, unguarded (their append succeeded)."""
    key = ("", 0, _shapes(riders))
    sql = _cache.get(key)
    if sql is None:
        sql = _cache[key] = f"WITH {', '.join(_numbered(key[2], 0, 'true'))} SELECT 1"
    return sql


def arguments(riders: Sequence[Rider]) -> list[Any]:
    """The riders' arguments, in the order :func:`riding` and :func:`alone` number them."""
    return [a for r in riders for a in r.args]


@contextmanager
def refusing(riders: Sequence[Rider]) -> Iterator[None]:
    """Raise the error of the rider whose ``conflict`` names the unique constraint that
    failed their statement, for the driver's (which stands when none does)."""
    try:
        yield
    except asyncpg.UniqueViolationError as exc:
        for rider in riders:
            if rider.conflict is not None and rider.conflict[0] == exc.constraint_name:
                raise rider.conflict[1]() from exc
        raise
