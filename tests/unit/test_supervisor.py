"""The Supervisor: restarts after transient failures, fails a component that cannot
recover, never lets a failure reach anything but the component."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from eventflow import BrokerError, ComponentFailedError, ConfigurationError, StoreError
from eventflow.supervision import ComponentState, RestartPolicy, Supervisor, is_transient

Wait = Callable[..., Awaitable[None]]
QUICK = RestartPolicy(initial_delay=0.001, max_delay=0.002, give_up_after=1.0, stable_after=0.2)


def test_transient_errors_are_those_that_may_pass() -> None:
    assert is_transient(BrokerError("down"))
    assert is_transient(StoreError("down"))
    assert is_transient(ConnectionResetError())
    assert is_transient(TimeoutError())
    assert not is_transient(ConfigurationError("bad URL"))
    assert not is_transient(TypeError("a bug"))
    assert is_transient(ExceptionGroup("g", [BrokerError("a"), OSError("b")]))
    assert not is_transient(ExceptionGroup("g", [BrokerError("a"), KeyError("b")]))


async def test_a_transient_failure_is_restarted_until_it_works() -> None:
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 4:
            raise BrokerError("not yet")

    supervisor = Supervisor("t", QUICK)
    component = supervisor.spawn("flaky", flaky)
    await asyncio.wait_for(component.wait(), 5)
    assert runs == [0, 1, 2, 3]
    assert component.restarts == 3
    assert component.state is ComponentState.STOPPED  # it returned: done
    assert supervisor.failure is None
    await supervisor.close()


async def test_a_permanent_failure_fails_the_component_and_tells_the_owner() -> None:
    told: list[ComponentFailedError] = []

    async def buggy() -> None:
        raise KeyError("missing")

    supervisor = Supervisor("t", QUICK, on_failure=told.append)
    component = supervisor.spawn("buggy", buggy)
    failure = await asyncio.wait_for(supervisor.wait_failed(), 5)
    assert told == [failure]
    assert failure.component == "buggy"
    assert isinstance(failure.__cause__, KeyError)
    assert component.state is ComponentState.FAILED
    assert component.restarts == 0
    assert supervisor.health().status == "failed"
    await supervisor.close()


async def test_a_component_failing_for_give_up_after_fails() -> None:
    async def always() -> None:
        raise StoreError("down for good")

    policy = RestartPolicy(initial_delay=0.01, max_delay=0.02, give_up_after=0.2)
    supervisor = Supervisor("t", policy)
    supervisor.spawn("down", always)
    failure = await asyncio.wait_for(supervisor.wait_failed(), 5)
    assert "kept failing for" in str(failure)
    await supervisor.close()


async def test_a_stable_run_starts_a_new_streak() -> None:
    """A component that ran well for longer than give_up_after, then fails once, is
    restarted: the streak starts at that failure, not at the start of the run."""
    runs: list[int] = []

    async def long_then_fails() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            await asyncio.sleep(1.5)  # longer than give_up_after (1.0) and stable_after
            raise BrokerError("a blip")

    supervisor = Supervisor("t", QUICK)
    component = supervisor.spawn("long", long_then_fails)
    await asyncio.wait_for(component.wait(), 5)
    assert runs == [0, 1]
    assert supervisor.failure is None
    await supervisor.close()


async def test_health_is_degraded_until_a_restarted_component_runs_stably(waiter: Wait) -> None:
    gate = asyncio.Event()
    runs: list[int] = []

    async def fails_once() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise BrokerError("blip")
        await gate.wait()

    supervisor = Supervisor("t", QUICK)
    supervisor.spawn("c", fails_once)
    await waiter(lambda: len(runs) == 2, what="the restart")
    health = supervisor.health()
    assert health.status == "degraded" and "c: running, 1 restarts (BrokerError: blip)" in (
        health.problems
    )
    await waiter(lambda: supervisor.health().ok, what="stable again past stable_after")
    gate.set()
    await supervisor.close()


async def test_a_cancellation_nobody_asked_for_is_a_failure() -> None:
    async def leaks_a_cancel() -> None:
        raise asyncio.CancelledError("from a future someone else cancelled")

    supervisor = Supervisor("t", QUICK)
    supervisor.spawn("leaky", leaks_a_cancel)
    failure = await asyncio.wait_for(supervisor.wait_failed(), 5)
    assert "cancelled from within" in str(failure)
    await supervisor.close()


async def test_close_cancels_every_component_and_nothing_else() -> None:
    outside = asyncio.create_task(asyncio.sleep(0.5))

    async def forever() -> None:
        await asyncio.Event().wait()

    supervisor = Supervisor("t", QUICK)
    components = [supervisor.spawn(f"c{n}", forever) for n in range(3)]
    await asyncio.sleep(0)
    await supervisor.close()
    assert all(c.state is ComponentState.STOPPED for c in components)
    assert not outside.done()  # an unrelated task goes on
    await outside
    with pytest.raises(RuntimeError, match="closed"):
        supervisor.spawn("late", forever)


async def test_a_component_whose_clean_up_fails_while_it_is_stopped_is_stopped(
    waiter: Wait,
) -> None:
    """Its cancellation came back as another error (closing a dead connection raised): still
    a stop, not a failure to restart, so ``close`` returns."""
    runs: list[int] = []

    async def cleanup_fails() -> None:
        runs.append(len(runs))
        try:
            await asyncio.Event().wait()
        finally:
            raise BrokerError("closing the subscription failed: not connected")

    supervisor = Supervisor("t", QUICK)
    component = supervisor.spawn("c", cleanup_fails)
    await waiter(lambda: runs == [0], what="the component running")
    await asyncio.wait_for(supervisor.close(), 3)
    assert runs == [0]
    assert component.state is ComponentState.STOPPED
    assert supervisor.failure is None


async def test_ended_components_are_forgotten_failed_ones_kept() -> None:
    async def ends() -> None:
        return None

    async def breaks() -> None:
        raise KeyError("bug")

    supervisor = Supervisor("t", QUICK)
    for n in range(50):
        await supervisor.spawn(f"sub{n}", ends).wait()
    failed = supervisor.spawn("broken", breaks)
    await failed.wait()
    assert supervisor.components == (failed,)
    await supervisor.close()


async def test_a_component_stopped_while_waiting_to_restart_says_stopped(waiter: Wait) -> None:
    async def down() -> None:
        raise StoreError("down")

    policy = RestartPolicy(initial_delay=5.0, max_delay=5.0, give_up_after=None)
    supervisor = Supervisor("t", policy)
    component = supervisor.spawn("c", down)
    await waiter(lambda: component.state is ComponentState.RETRYING, what="the retry wait")
    await supervisor.close()
    assert component.state is ComponentState.STOPPED


async def test_a_task_group_failure_inside_a_component_is_restarted_not_taken_for_a_stop() -> None:
    """A child of a task group inside the component fails after the group's body ended:
    Python 3.11 then leaves a cancel request counted on the component's task. That is no
    stop asked by the owner: the transient error restarts the component."""
    runs: list[int] = []

    async def late_child_failure() -> None:
        runs.append(len(runs))
        if len(runs) > 1:
            return
        async with asyncio.TaskGroup() as tg:

            async def child() -> None:
                await asyncio.sleep(0.01)
                raise StoreError("the store went away")

            tg.create_task(child())  # the body ends here; the child fails afterwards

    supervisor = Supervisor("t", QUICK)
    component = supervisor.spawn("tg", late_child_failure)
    await asyncio.wait_for(component.wait(), 5)
    assert runs == [0, 1]
    assert component.restarts == 1
    await supervisor.close()


class _NoJitter(RestartPolicy):
    """Waits ``initial_delay`` before every restart."""

    def backoff(self, restart: int) -> float:
        return self.initial_delay


async def test_finish_ends_a_wait_for_a_restart_and_stops_restarting(waiter: Wait) -> None:
    """``finish()`` on a component waiting 30 s for its restart ends it at once, stopped,
    not failed; a running one that then fails transiently is not restarted (a positive
    control: without ``finish()`` the same component restarts)."""
    slow = _NoJitter(initial_delay=30.0, max_delay=30.0, give_up_after=None)
    runs: list[int] = []

    async def failing() -> None:
        runs.append(1)
        raise BrokerError("down")

    supervisor = Supervisor("t", slow)
    waiting = supervisor.spawn("waiting", failing)
    await waiter(lambda: waiting.state is ComponentState.RETRYING)
    waiting.finish()
    await asyncio.wait_for(waiting.wait(), 1.0)
    assert waiting.state is ComponentState.STOPPED and runs == [1]

    go = asyncio.Event()

    async def fails_when_told() -> None:
        runs.append(2)
        await go.wait()
        raise BrokerError("down")

    for finish in (True, False):
        runs.clear()
        go.clear()
        component = Supervisor("t", QUICK).spawn("draining", fails_when_told)
        await waiter(lambda: runs == [2])
        if finish:
            component.finish()
        go.set()
        if finish:
            await asyncio.wait_for(component.wait(), 1.0)
            assert component.state is ComponentState.STOPPED and runs == [2]
        else:
            await waiter(lambda: len(runs) >= 2, what="restarted without finish()")
            await component.stop()
    assert supervisor.failure is None
    await supervisor.close()
