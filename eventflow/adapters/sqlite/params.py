"""Numbered parameters (``$1, $2, ...``) for user SQL on SQLite.

Every eventflow SQL store takes one parameter style in the SQL of ``ctx.transaction()`` and of
projections: PostgreSQL's ``$1, $2, ...``. SQLite numbers its parameters ``?1, ?2, ...``, so
``to_sqlite`` rewrites each ``$N`` as ``?N``, and refuses the placeholders that only SQLite
understands (``?``, ``?N``, ``:name``, ``@name``, ``$name``, ``#name``): code written against
the SQLite store then runs unchanged on PostgreSQL, instead of failing there with a syntax
error.

It follows SQLite's own lexer, since SQLite runs the result: nothing is rewritten or refused
inside string literals (``'...'``, ``''`` inside one is a quote), quoted identifiers
(``"..."``, `````...`````, ``[...]``), comments (``-- ...`` to the end of the line, ``/* ...
*/``, which do not nest in SQLite), or words (``a$1`` is one identifier in both databases).
PostgreSQL-only syntax is left for SQLite to reject, except dollar-quoted strings (``$$...$$``,
``$tag$...$tag$``), which would otherwise read as placeholders: they are refused with advice.
"""

from __future__ import annotations

from functools import lru_cache

from ...errors import ConfigurationError

__all__ = ["to_sqlite"]

_STYLE = "use $1, $2, ... (the one parameter style of every eventflow SQL store)"
_SPECIAL = frozenset("$?:@#'\"`[-/")


def _is_word(c: str) -> bool:
    """A character of SQLite's identifiers and keywords (after the first): letters, digits,
    ``_``, ``$`` and anything beyond ASCII."""
    return c.isalnum() or c == "_" or c == "$" or c > "\x7f"


def _placeholder_error(sql: str, at: int, found: str) -> ConfigurationError:
    return ConfigurationError(
        f"SQL placeholder {found!r} at offset {at} of {sql!r} is SQLite-only: {_STYLE}, "
        "so the same SQL runs on PostgreSQL"
    )


def _end_of_quoted(sql: str, start: int, close: str) -> int:
    """The index after the quoted token opened at ``start`` (a doubled closing quote stays
    inside it); the end of the text when it is not closed (SQLite then reports it)."""
    i = start + 1
    while True:
        j = sql.find(close, i)
        if j < 0:
            return len(sql)
        if close != "]" and sql.startswith(close, j + 1):
            i = j + 2
            continue
        return j + 1


def _end_of_word(sql: str, start: int) -> int:
    i = start + 1
    while i < len(sql) and _is_word(sql[i]):
        i += 1
    return i


@lru_cache(maxsize=512)
def to_sqlite(sql: str) -> str:
    """``sql`` with each ``$N`` placeholder as SQLite's ``?N``; raises ``ConfigurationError``
    for SQLite-only placeholders and for dollar-quoted strings. Cached: projections run the
    same few statements for every event."""
    if not _SPECIAL.intersection(sql):
        return sql
    out: list[str] = []
    done = 0  # sql[:done] is in out
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        nxt = sql[i + 1] if i + 1 < n else ""
        if c in "'\"`[":
            i = _end_of_quoted(sql, i, "]" if c == "[" else c)
        elif c == "-" and nxt == "-":
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif c == "/" and nxt == "*":
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c == "$" and nxt.isdigit():
            j = i + 1
            while j < n and sql[j].isdigit():
                j += 1
            out.append(sql[done:i])
            out.append("?" + sql[i + 1 : j])
            done = i = j
        elif c == "$" and (nxt == "$" or _is_word(nxt)):
            j = i + 1  # past the tag of a dollar quote, or the name of a placeholder
            while j < n and _is_word(sql[j]) and sql[j] != "$":
                j += 1
            if j < n and sql[j] == "$":
                raise ConfigurationError(
                    f"dollar-quoted string {sql[i : j + 1]!r} at offset {i} of {sql!r}: "
                    "dollar quoting is PostgreSQL-only; write a '...' string (double a quote "
                    "inside it: 'it''s'), which both databases read"
                )
            raise _placeholder_error(sql, i, sql[i:j])
        elif c == "?":
            j = i + 1
            while j < n and sql[j].isdigit():
                j += 1
            raise _placeholder_error(sql, i, sql[i:j])
        elif c in ":@#" and _is_word(nxt) and nxt != "$":
            raise _placeholder_error(sql, i, sql[i : _end_of_word(sql, i)])
        elif c == ":" and nxt == ":":
            i += 2  # a PostgreSQL cast: SQLite rejects it itself, not as a placeholder
        elif c.isalpha() or c == "_" or c > "\x7f":
            i = _end_of_word(sql, i)  # `a$1` is an identifier, not `a` and a placeholder
        else:
            i += 1
    if not out:
        return sql
    out.append(sql[done:])
    return "".join(out)
