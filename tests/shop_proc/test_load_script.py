"""``examples.shop.load``'s bookkeeping, against an orders API answered in the test
(``httpx.MockTransport``): what it counts as accepted, refused, final and lost."""

from __future__ import annotations

import json
import math
from collections import Counter

import httpx
import pytest

from examples.shop import load
from examples.shop.load import main, percentile, run_load


class _Orders:
    """An orders API: every third POST is held until final (200), the others answer 202
    and become final on their second GET; ``never`` stay pending, ``refuse`` get a 503."""

    def __init__(self, *, never: set[int], refuse: set[int]) -> None:
        self.never = never
        self.refuse = refuse
        self.gets: Counter[str] = Counter()
        self.bodies: dict[str, object] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            body = json.loads(request.content)
            order_id = body["order_id"]
            n = int(order_id.rsplit("-", 1)[1])
            self.bodies[order_id] = body
            if n in self.refuse:
                return httpx.Response(503, json={"detail": "busy"})
            assert request.url.params["wait"] == "5"
            if n % 3 == 0 and n not in self.never:
                return httpx.Response(200, json={"order_id": order_id, "status": "completed"})
            return httpx.Response(202, json={"order_id": order_id, "status": "pending"})
        if request.url.path == "/orders":  # the list of one status
            wanted = request.url.params["status"]
            listed = [self._look(o) for o in self.bodies]
            return httpx.Response(
                200, json={"orders": [o for o in listed if o["status"] == wanted]}
            )
        return httpx.Response(200, json=self._look(request.url.path.rsplit("/", 1)[1]))

    def _look(self, order_id: str) -> dict[str, str]:
        n = int(order_id.rsplit("-", 1)[1])
        self.gets[order_id] += 1
        final = n not in self.never and n not in self.refuse and self.gets[order_id] >= 2
        status = ("compensated" if n % 2 else "completed") if final else "pending"
        return {"order_id": order_id, "status": status}


@pytest.mark.parametrize("listing", [False, True], ids=["per-order", "by-status-lists"])
async def test_load_counts_accepted_refused_final_and_lost(
    listing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if listing:  # a backlog: poll with GET /orders?status=... from the first pending order
        monkeypatch.setattr(load, "LIST_ABOVE", 0)
        monkeypatch.setattr(load, "LIST_INTERVAL", load.POLL_INTERVAL)
    api = _Orders(never={4, 7}, refuse={5})
    result = await run_load(
        "http://shop.test",
        rate=200,
        duration=0.1,
        wait=5,
        settle=1.0,
        skus=["sku-1", "sku-2"],
        seed=1,
        transport=httpx.MockTransport(api),
    )
    assert result.sent == 20 and result.accepted == 19
    assert result.refused == {"HTTP 503": 1}
    assert sorted(o.rsplit("-", 1)[1] for o in result.lost) == ["4", "7"]
    assert sum(result.statuses.values()) == 17 == len(result.latencies)
    assert result.statuses["compensated"] > 0 and result.statuses["completed"] > 0
    for body in api.bodies.values():  # small orders of the given SKUs
        assert isinstance(body, dict)
        assert {line["sku"] for line in body["lines"]} <= {"sku-1", "sku-2"}
    report = result.as_dict()
    assert report["lost"] == result.lost and report["accepted"] == 19


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.50) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values[:1], 0.99) == 1.0
    assert math.isnan(percentile([], 0.5))


def test_main_exits_1_when_nothing_answers(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--rate", "10", "--duration", "0.2", "--url", "http://127.0.0.1:9", "--json"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    assert report["sent"] == 2 and report["accepted"] == 0
    assert report["refused"] == {"ConnectError": 2}, report
