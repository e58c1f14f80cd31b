"""``hashed_id`` must give the same id for the same parts in every release: a saga's
commands and transitions keep their ids across re-runs, restarts and deploys (DESIGN 5),
so a participant's dedup drops a command sent again by a newer version."""

from __future__ import annotations

import re

import pytest

from eventflow.envelope import hashed_id

_UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@pytest.mark.parametrize(
    ("ms", "parts", "expected"),
    [
        (0, ("a",), "00000000-0000-7b1f-8979-bd34e716e325"),
        (
            1733220000000,
            ("saga-bench.order-abc-1", "0193aaaa-bbbb-7ccc-8ddd-eeeeeeeeeeee", "0"),
            "01938bf6-6100-7635-8562-38e46ecb3689",
        ),
        ((1 << 48) + 5, ("x", "", "é\x00z"), "00000000-0005-7ed4-8506-82dc1ad36480"),
        (
            281474976710655,
            ("saga", "order", "o-1", "do", "reserve", "1"),
            "ffffffff-ffff-752f-9beb-4d1b4dfe066f",
        ),
    ],
)
def test_the_same_parts_give_the_id_earlier_releases_gave(
    ms: int, parts: tuple[str, ...], expected: str
) -> None:
    assert hashed_id(ms, *parts) == expected
    assert _UUID7.match(expected)


def test_ids_are_uuid7_shaped_and_differ_with_the_parts() -> None:
    ids = {hashed_id(1733220000000 + n % 3, "saga", str(n)) for n in range(2000)}
    assert len(ids) == 2000
    assert all(_UUID7.match(i) for i in ids)
