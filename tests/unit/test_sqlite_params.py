"""The SQLite store's translation of ``$1, $2, ...`` (the one parameter style of every
eventflow SQL store) to SQLite's ``?1, ?2, ...``, and its refusal of SQLite-only styles."""

from __future__ import annotations

import sqlite3

import pytest

from eventflow import ConfigurationError
from eventflow.adapters.sqlite.params import to_sqlite


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT 1", "SELECT 1"),
        ("SELECT $1", "SELECT ?1"),
        ("VALUES ($2, $1, $10)", "VALUES (?2, ?1, ?10)"),
        ("SELECT $1+$2", "SELECT ?1+?2"),
        ("WHERE a=$1 AND b=$1", "WHERE a=?1 AND b=?1"),
        # literals and quoted identifiers are left alone, placeholders around them are not
        ("SELECT '$1', $1", "SELECT '$1', ?1"),
        ("SELECT 'it''s $1 or ?', $2", "SELECT 'it''s $1 or ?', ?2"),
        ("SELECT '', $1", "SELECT '', ?1"),
        ('SELECT "$1 ?" FROM t WHERE x = $1', 'SELECT "$1 ?" FROM t WHERE x = ?1'),
        ('SELECT "a""$1" , $1', 'SELECT "a""$1" , ?1'),
        ("SELECT `$1`, [col ? $2], $3", "SELECT `$1`, [col ? $2], ?3"),
        ("SELECT x'24' , $1", "SELECT x'24' , ?1"),
        # comments
        ("SELECT $1 -- why? $2\n, $2", "SELECT ?1 -- why? $2\n, ?2"),
        ("SELECT $1 -- to the end, $2", "SELECT ?1 -- to the end, $2"),
        ("SELECT /* :x ? $1 */ $1", "SELECT /* :x ? $1 */ ?1"),
        ("SELECT $1 /* open to the end ?", "SELECT ?1 /* open to the end ?"),
        ("SELECT 5 - $1, 6 / $2", "SELECT 5 - ?1, 6 / ?2"),
        # words: `$` inside an identifier is part of it (in both databases)
        ("SELECT a$1, $1 FROM t$2", "SELECT a$1, ?1 FROM t$2"),
        # operators that look like placeholder prefixes
        ("SELECT a::text", "SELECT a::text"),
        ("SELECT $1 @@ $2, a @> b, @ -1", "SELECT ?1 @@ ?2, a @> b, @ -1"),
        ("SELECT $", "SELECT $"),
        ("SELECT 'unterminated $1", "SELECT 'unterminated $1"),
    ],
)
def test_numbered_parameters_become_sqlite_numbered_ones(sql: str, expected: str) -> None:
    assert to_sqlite(sql) == expected


@pytest.mark.parametrize(
    ("sql", "found"),
    [
        ("SELECT ?", "'?'"),
        ("INSERT INTO t VALUES (?, ?)", "'?'"),
        ("SELECT ?2", "'?2'"),
        ("SELECT :name", "':name'"),
        ("SELECT @name", "'@name'"),
        ("SELECT $name", "'$name'"),
        ("SELECT #name", "'#name'"),
        ("SELECT '?' || ?", "'?' at offset 14"),
        ("SELECT 1 -- ok ?\n, ?", "'?' at offset 19"),
    ],
)
def test_sqlite_only_placeholders_are_refused_with_the_style_to_use(sql: str, found: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        to_sqlite(sql)
    message = str(caught.value)
    assert found in message
    assert "use $1, $2, ..." in message and "PostgreSQL" in message


@pytest.mark.parametrize(
    "sql", ["SELECT $$a ? b$$", "SELECT $body$ x $body$", "SELECT $a_1$x$a_1$"]
)
def test_dollar_quoting_is_refused_as_postgresql_only(sql: str) -> None:
    with pytest.raises(ConfigurationError, match="dollar quoting is PostgreSQL-only"):
        to_sqlite(sql)


def test_the_translation_binds_each_number_to_its_argument() -> None:
    conn = sqlite3.connect(":memory:")
    sql = "SELECT $2, '$1', $1, $2 -- $3\n"
    assert conn.execute(to_sqlite(sql), ("one", "two")).fetchall() == [("two", "$1", "one", "two")]
