"""``@subscribe(timeout=..., hard_timeout=...)`` in a real process on real brokers: a handler
that blocks the event loop with ``time.sleep(60)`` makes its app log the blocking stack and
exit with status 70 past the hard timeout, and another member of the group handles the
message (DESIGN section 9).

The servers come from ``eventflow.testing`` (bundled binaries); without them the tests
skip, or fail under ``CI=true``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from eventflow import App
from eventflow.runtime.stall import HARD_TIMEOUT_EXIT_CODE
from eventflow.testing.broker_contract import eventually, unique_name
from eventflow.testing.kafka_server import fast_test_url, kafka_service_url
from eventflow.testing.nats_server import nats_service_url

from .children import Child, launch
from .hanging_member import HangJob

MEMBER = Path(__file__).with_name("hanging_member.py")


@pytest.fixture(scope="module")
def nats_base() -> Iterator[str]:
    with nats_service_url() as url:
        yield url


@pytest.fixture(scope="module")
def kafka_base() -> Iterator[str]:
    with kafka_service_url() as url:
        yield fast_test_url(url)


@pytest.fixture(
    params=[
        pytest.param("nats", marks=pytest.mark.service("nats")),
        pytest.param("kafka", marks=pytest.mark.service("kafka")),
    ]
)
def broker_url(request: pytest.FixtureRequest) -> str:
    """A broker URL with fast failure detection, on a stream (NATS) or topics (Kafka) of the
    test's own."""
    if request.param == "nats":
        base: str = request.getfixturevalue("nats_base")
        stream = unique_name("HT").upper()
        return f"{base}?stream={stream}&ack_wait=2&heartbeat_interval=0.25&partitions=4"
    url: str = request.getfixturevalue("kafka_base")
    return f"{url}&topic_prefix={unique_name('ht')}."


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def test_a_handler_blocking_the_loop_past_its_hard_timeout_ends_the_process(
    broker_url: str, tmp_path: Path
) -> None:
    group = unique_name("hang")
    hung_out, hung_log = tmp_path / "hung.out", tmp_path / "hung.log"
    work_out, work_log = tmp_path / "work.out", tmp_path / "work.log"
    hung = Child(
        await launch(
            MEMBER, broker_url, group, "hang", str(hung_out), str(hung_log), what="hanging"
        )
    )
    worker: Child | None = None
    try:
        async with App("hang-publisher", broker=broker_url) as app:
            await app.publish(HangJob(n=7), key="job-7")
        await eventually(
            lambda: "started 7" in _lines(hung_out), timeout=30, message="the hang began"
        )
        # The other member joins only now, so the message went to the hanging one first.
        worker = Child(
            await launch(
                MEMBER, broker_url, group, "work", str(work_out), str(work_log), what="working"
            )
        )
        code = await asyncio.wait_for(hung.proc.wait(), 60)
        assert code == HARD_TIMEOUT_EXIT_CODE
        log = hung_log.read_text()
        assert "hard_timeout=2s" in log and "Ending the process with exit status 70" in log
        assert "time.sleep(60)" in log  # the blocking line, from the loop's thread
        await eventually(
            lambda: any(line.startswith("handled 7 ") for line in _lines(work_out)),
            timeout=60,
            message="the other member handled the message",
        )
        assert _lines(hung_out) == ["started 7"]  # the hanging member never got past it
    finally:
        await hung.kill()
        if worker is not None:
            await worker.stop()
