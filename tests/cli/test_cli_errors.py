"""Errors a person can act on (issue 22, item 7): each message names what is wrong and what
to do, with the file and line where the user's code raised, never a traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from cli_support import fill, letter_ids, make_beat, make_letter

from eventflow.cli import main

PG = "postgresql://postgres@127.0.0.1:5432/test"


def _app_module(tmp_path: Path, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return name


@pytest.mark.parametrize("pool", ["abc", "0", "99999999999999999999"])
def test_a_bad_pool_option_is_one_line_and_a_huge_one_does_not_hang(
    pool: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pool=abc`` is refused; so is a pool beyond 1000, which asyncpg would try to set up
    slot by slot (the process hung)."""
    assert main(["status", "--store", f"{PG}?pool={pool}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eventflow: error: URL option pool=") and "Traceback" not in err
    assert "from 1 to 1000" in err


def test_asyncapi_into_a_missing_directory_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _app_module(
        tmp_path,
        "apiapp_missing_dir",
        """
        from eventflow import App
        app = App("api")
        """,
    )
    argv = ["schema", "asyncapi", "--app", f"{mod}:app", "--app-dir", str(tmp_path)]
    assert main([*argv, "-o", "/nonexistent/dir/a.json"]) == 2
    err = capsys.readouterr().err
    assert "cannot write '/nonexistent/dir/a.json'" in err and "No such file" in err
    assert "Traceback" not in err


def test_an_exception_while_importing_the_app_names_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _app_module(
        tmp_path,
        "broken_at_line_4",
        """
        from eventflow import App

        raise RuntimeError("settings missing")
        app = App("broken")
        """,
    )
    assert main(["status", "--app", f"{mod}:app", "--app-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "raised RuntimeError at " in err and "broken_at_line_4.py:4: settings missing" in err


def test_a_syntax_error_in_the_app_names_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = _app_module(tmp_path, "syntax_at_line_3", "x = 1\n\ndef f(:\n")
    assert main(["status", "--app", f"{mod}:app", "--app-dir", str(tmp_path)]) == 2
    assert "syntax_at_line_3.py:3" in capsys.readouterr().err


def test_projections_status_of_an_app_without_projections_does_not_ask_for_app(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    fill(url)
    mod = _app_module(
        tmp_path,
        "no_projections_app",
        f"""
        from eventflow import App
        app = App("plain", store={url!r})
        """,
    )
    assert main(["projections", "status", "--app", f"{mod}:app", "--app-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pass --app" not in out
    assert f"the app {mod}:app has no projections" in out


def test_dlq_purge_without_ids_says_neither_was_given(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "purge", "--store", store_url]) == 2
    err = capsys.readouterr().err
    assert "not both" not in err and "neither was given" in err
    assert main(["dlq", "purge", "dl-1", "--all", "--store", store_url]) == 2
    assert "not both" in capsys.readouterr().err


def test_dlq_list_limit_zero_is_refused_not_reported_empty(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "list", "--limit", "0", "--store", store_url]) == 2
    captured = capsys.readouterr()
    assert "--limit must be 1 or more" in captured.err
    assert "no dead letters" not in captured.out


def test_status_footer_names_the_store_given(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    assert f"eventflow dlq list --store '{store_url}'" in out
    assert "--store URL" not in out


def test_dlq_show_takes_a_unique_prefix_and_names_an_ambiguous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'pre.db'}"
    fill(
        url,
        [
            make_letter(1, id="0193a1b2-aaaa"),
            make_letter(2, id="0193a1b2-bbbb"),
            make_letter(3, id="0193ffff-cccc"),
        ],
    )
    assert main(["dlq", "show", "0193ff", "--store", url]) == 0
    assert "0193ffff-cccc" in capsys.readouterr().out
    assert main(["dlq", "show", "0193a1", "--store", url]) == 1
    err = capsys.readouterr().err
    assert "ambiguous" in err and "0193a1b2-aaaa" in err and "0193a1b2-bbbb" in err
    assert main(["dlq", "show", "zz", "--store", url]) == 1
    assert "no dead letter 'zz'" in capsys.readouterr().err
    assert main(["dlq", "purge", "0193ff", "--store", url]) == 0
    assert letter_ids(url) == ["0193a1b2-aaaa", "0193a1b2-bbbb"]


def test_status_lists_many_subscriptions_one_a_line(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    subs = tuple(f"orders:shop.orders.topic-with-a-long-name-{i}" for i in range(11))
    fill(store_url, beats=[make_beat("orders", subscriptions=subs)])
    assert main(["status", "--store", store_url]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "orders@host:42:abc" in line)
    assert "+9 more" in row and len(row) < 200
    listed = [line.strip() for line in out.splitlines() if line.startswith("    orders:")]
    assert listed == list(subs)


def test_sagas_retry_of_an_unknown_id_names_the_store(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sagas", "retry", "saga-trip-nope", "--by", "ann", "--store", store_url]) == 1
    err = capsys.readouterr().err
    assert f"no saga 'saga-trip-nope' in store {store_url}" in err


@pytest.mark.parametrize(
    ("option", "url", "words"),
    [
        ("--store", "postgresql://h:abc/db", "port 'abc'"),
        ("--store", "postgresql://[::1/db", "cannot be read"),
        ("--broker", "nats://127.0.0.1:abc", "port 'abc'"),
        ("--broker", "kafka://[::1", "cannot be read"),
    ],
)
def test_a_bad_port_or_an_unreadable_url_is_one_line(
    option: str, url: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port that is not a number, or a URL urllib cannot split, was a ValueError traceback
    (or, for a broker, accepted until the first connection)."""
    store = f"sqlite:///{tmp_path / 's.db'}"
    fill(store)
    argv = ["status", "--store", store, option, url]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("eventflow: error: ") and words in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "default"),
    [
        (["sagas", "list"], "the default is 100"),
        (["dlq", "list"], "the default is 100"),
        (["store", "read", "--all"], "the default: every event"),
        (["store", "read", "order-1"], "the default: every event"),
    ],
)
@pytest.mark.parametrize("limit", ["0", "-3"])
def test_a_limit_below_one_is_refused_not_reported_empty(
    argv: list[str], default: str, limit: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--limit 0`` said there were no sagas / no events, as ``dlq list`` did."""
    store = f"sqlite:///{tmp_path / 'l.db'}"
    fill(store)
    command = " ".join(argv[:2])
    assert main([*argv, "--limit", limit, "--store", store]) == 2
    captured = capsys.readouterr()
    assert f"{command}: --limit must be 1 or more, got {limit}" in captured.err
    assert default in captured.err and captured.out == ""
