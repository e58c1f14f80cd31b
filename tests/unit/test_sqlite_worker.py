"""The SQLite database thread: jobs in order, outcomes to the loop, and a job whose caller
was cancelled still runs."""

from __future__ import annotations

import asyncio
import threading

import pytest

from eventflow.adapters.sqlite.worker import Worker


async def test_jobs_run_in_order_on_one_thread_and_return_their_outcome() -> None:
    worker = Worker("test-sqlite-worker")
    try:
        seen: list[tuple[int, str]] = []

        def job(n: int) -> int:
            seen.append((n, threading.current_thread().name))
            return n * 10

        results = await asyncio.gather(*(worker.submit(job, n) for n in range(20)))
        assert results == [n * 10 for n in range(20)]
        assert [n for n, _ in seen] == list(range(20))
        assert {name for _, name in seen} == {"test-sqlite-worker"}

        def fail() -> None:
            raise KeyError("boom")

        with pytest.raises(KeyError, match="boom"):
            await worker.submit(fail)
        assert await worker.submit(job, 7) == 70  # a failed job does not stop the thread
    finally:
        worker.stop()


async def test_a_job_whose_caller_was_cancelled_still_runs() -> None:
    worker = Worker("test-sqlite-worker")
    release, ran = threading.Event(), threading.Event()
    try:
        blocker = worker.submit(release.wait, 10)
        cancelled = worker.submit(ran.set)
        cancelled.cancel()
        release.set()
        assert await blocker is True
        await worker.submit(lambda: None)  # every job before it has run
        assert ran.is_set()
    finally:
        worker.stop()


async def test_stop_runs_what_was_queued_then_ends_the_thread() -> None:
    worker = Worker("test-sqlite-worker")
    done = threading.Event()
    future = worker.submit(done.set)
    worker.stop()
    assert done.is_set()
    await asyncio.sleep(0)  # the outcome reaches the loop
    assert future.done()
    assert not worker._thread.is_alive()
