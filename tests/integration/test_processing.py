"""Processing semantics on the memory broker: order, idempotency, retries, timeouts, outbox."""

import asyncio
import itertools
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import pytest

from eventflow import (
    App,
    ConfigurationError,
    Context,
    Envelope,
    Event,
    RetryPolicy,
    subscribe,
)
from eventflow.adapters.memory import MemoryBroker
from eventflow.adapters.memory.broker import MemoryBrokerConfig
from eventflow.subscribe import DEFAULT_TIMEOUT

Wait = Callable[..., Awaitable[None]]


class Seq(Event, type="it.proc.seq"):
    key: str
    n: int


class Cause(Event, type="it.proc.cause"):
    n: int


class Effect(Event, type="it.proc.effect"):
    n: int
    attempt: int = 0


class Work(Event, type="it.proc.work"):
    n: int


class Other(Event, type="it.proc.other"):
    text: str


def fast_retry(attempts: int, initial: float = 0.01, cap: float = 0.05) -> RetryPolicy:
    return RetryPolicy(max_attempts=attempts, initial_delay=initial, max_delay=cap)


# -- (a) per-key order with concurrency --------------------------------------------------------


async def test_per_key_order_with_concurrency(broker_url: str, waiter: Wait) -> None:
    keys = 100
    total = 10_000
    seen: dict[str, list[int]] = defaultdict(list)
    active = 0
    max_active = 0
    in_key: set[str] = set()
    overlap_in_key = []

    @subscribe("it.proc.seq", group="ordered", concurrency=8)
    async def handle(event: Seq) -> None:
        nonlocal active, max_active
        if event.key in in_key:
            overlap_in_key.append(event.key)  # two messages of one key at once
        in_key.add(event.key)
        active += 1
        max_active = max(max_active, active)
        try:
            await asyncio.sleep(0)  # let the other workers interleave
            seen[event.key].append(event.n)
        finally:
            active -= 1
            in_key.discard(event.key)

    async with App("it-proc-order", broker=broker_url, handlers=[handle]) as app:
        for n in range(total):
            key = f"k{n % keys}"
            await app.publish(Seq(key=key, n=n), key=key)
        await waiter(lambda: sum(map(len, seen.values())) == total, timeout=60, what="all handled")

    assert len(seen) == keys
    for k in range(keys):
        assert seen[f"k{k}"] == list(range(k, total, keys)), f"key k{k} out of order"
    assert not overlap_in_key
    assert 1 < max_active <= 8  # keys really ran in parallel, never past the limit


async def test_single_worker_keeps_publish_order(broker_url: str, waiter: Wait) -> None:
    seen: list[int] = []

    @subscribe("it.proc.seq", group="serial")
    async def handle(event: Seq) -> None:
        seen.append(event.n)

    async with App("it-proc-serial", broker=broker_url, handlers=[handle]) as app:
        for n in range(500):
            await app.publish(Seq(key="only", n=n), key="only")
        await waiter(lambda: len(seen) == 500)
    assert seen == list(range(500))


# -- (b) duplicates ----------------------------------------------------------------------------


async def test_republished_duplicates_are_handled_zero_times(broker_url: str, waiter: Wait) -> None:
    handled: list[str] = []

    @subscribe("it.proc.work", group="dedup", concurrency=8)
    async def handle(event: Work, ctx: Context) -> None:
        handled.append(ctx.envelope.id)

    async with App("it-proc-dedup", broker=broker_url, handlers=[handle]) as app:
        sent = [await app.publish(Work(n=n), key=f"k{n % 10}") for n in range(500)]
        await waiter(lambda: len(handled) == 500, what="first deliveries")
        for env in sent:  # the same envelopes again, through the app
            await app.publish(env)
        for env in sent:  # and as raw bytes, as a foreign producer would
            await app.broker.publish("it.proc.work", env.to_bytes(), key=env.key)
        await waiter(
            lambda: app.stats()["dedup:it.proc.work"]["duplicates"] == 1000,
            what="duplicates skipped",
        )
        stats = app.stats()["dedup:it.proc.work"]

    assert sorted(handled) == sorted(e.id for e in sent)
    assert len(set(handled)) == 500
    assert stats["handled"] == 500
    assert stats["received"] == 1500


async def test_republished_envelope_keeps_its_identity(broker_url: str, waiter: Wait) -> None:
    got: list[Envelope] = []

    @subscribe("it.proc.other", group="raw", idempotent=False)
    async def handle(env: Envelope) -> None:
        got.append(env)

    async with App("it-proc-identity", broker=broker_url, handlers=[handle]) as app:
        original = await app.publish(Other(text="x"), key="k", headers={"h": "v"})
        again = await app.publish(original)
        await waiter(lambda: len(got) == 2)
    assert again is original
    assert got[0] == got[1] == original


async def test_concurrent_keyless_duplicates_handled_once(broker_url: str, waiter: Wait) -> None:
    # Bug B1 (fixed): the seen-check raced with the mark of a concurrent copy.
    calls: list[int] = []

    @subscribe("it.proc.work", group="racy", concurrency=8)
    async def handle(event: Work) -> None:
        calls.append(event.n)
        await asyncio.sleep(0.05)

    async with App("it-proc-racy", broker=broker_url, handlers=[handle]) as app:
        env = await app.publish(Work(n=1))
        await app.publish(env)
        await app.publish(env)
        await waiter(lambda: app.stats()["racy:it.proc.work"]["received"] == 3)
        await waiter(
            lambda: (
                app.stats()["racy:it.proc.work"]["handled"]
                + app.stats()["racy:it.proc.work"]["duplicates"]
                == 3
            )
        )
        assert app.stats()["racy:it.proc.work"]["duplicates"] == 2
    assert calls == [1]


async def test_non_idempotent_handlers_see_every_copy(broker_url: str, waiter: Wait) -> None:
    calls: list[int] = []

    @subscribe("it.proc.work", group="every", idempotent=False)
    async def handle(event: Work) -> None:
        calls.append(event.n)

    async with App("it-proc-every", broker=broker_url, handlers=[handle]) as app:
        env = await app.publish(Work(n=7), key="k")
        await app.publish(env)
        await waiter(lambda: len(calls) == 2)
    assert calls == [7, 7]


# -- (c) retry then success --------------------------------------------------------------------


async def test_fail_twice_then_succeed(broker_url: str, waiter: Wait) -> None:
    attempts: list[int] = []
    done: list[int] = []

    @subscribe("it.proc.work", group="flaky", retry=fast_retry(5))
    async def handle(event: Work, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt < 3:
            raise RuntimeError(f"transient failure {ctx.attempt}")
        done.append(event.n)

    async with App("it-proc-flaky", broker=broker_url, handlers=[handle]) as app:
        await app.publish(Work(n=1), key="k")
        await waiter(lambda: done == [1])
        await waiter(lambda: app.stats()["flaky:it.proc.work"]["handled"] == 1)
        stats = app.stats()["flaky:it.proc.work"]
        letters = await app.dead_letters.list()
    assert attempts == [1, 2, 3]
    assert stats["retries"] == 2
    assert stats["dead_lettered"] == 0
    assert letters == []


async def test_default_retry_is_three_attempts(broker_url: str, waiter: Wait) -> None:
    attempts: list[int] = []

    @subscribe("it.proc.work", group="default-retry")
    async def handle(event: Work, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        raise ValueError("always")

    async with App("it-proc-default", broker=broker_url, handlers=[handle]) as app:
        await app.publish(Work(n=1))
        await waiter(lambda: app.stats()["default-retry:it.proc.work"]["dead_lettered"] == 1)
    assert attempts == [1, 2, 3]


# -- (d) always failing: DLQ after max_attempts with backoff ----------------------------------


@dataclass(frozen=True, slots=True)
class RecordingPolicy(RetryPolicy):
    """A RetryPolicy that remembers the delays it chose (to compare with the real gaps)."""

    chosen: list[float] = field(default_factory=list, compare=False)

    def delay(self, attempt: int) -> float:
        value = RetryPolicy.delay(self, attempt)
        self.chosen.append(value)
        return value


async def test_always_failing_handler_is_dead_lettered_after_max_attempts(
    broker_url: str, waiter: Wait
) -> None:
    policy = RecordingPolicy(max_attempts=4, initial_delay=0.02, multiplier=2.0, max_delay=0.05)
    calls: list[float] = []

    @subscribe("it.proc.work", group="doomed", retry=policy)
    async def handle(event: Work, ctx: Context) -> None:
        calls.append(time.monotonic())
        raise RuntimeError(f"boom on attempt {ctx.attempt}")

    async with App("it-proc-doomed", broker=broker_url, handlers=[handle]) as app:
        env = await app.publish(Work(n=5), key="w-5")
        await waiter(lambda: app.stats()["doomed:it.proc.work"]["dead_lettered"] == 1)
        letters = await app.dead_letters.list()

    assert len(calls) == policy.max_attempts == 4
    gaps = [b - a for a, b in itertools.pairwise(calls)]
    assert len(policy.chosen) == 3
    for n, (gap, chosen) in enumerate(zip(gaps, policy.chosen, strict=True), start=1):
        assert 0 <= chosen <= policy.backoff_cap(n)
        assert gap > 0
        assert gap >= chosen - 0.002  # the consumer really slept the chosen backoff
        assert gap <= policy.backoff_cap(n) + 0.5  # and not much more (generous for slow CI)
    (letter,) = letters
    assert letter.attempts == 4
    assert letter.group == "doomed"
    assert letter.topic == "it.proc.work"
    assert letter.payload == env.to_bytes()
    assert Envelope.from_bytes(letter.payload) == env
    assert "RuntimeError: boom on attempt 4" in letter.error
    assert "Traceback" in letter.error  # the handler's stack, for debugging
    assert letter.reason == "handler-failed"
    assert letter.envelope_id == env.id
    assert letter.key == "w-5"
    assert letter.failed_at.utcoffset() is not None


async def test_dead_letter_false_drops_with_an_error_log(
    broker_url: str, waiter: Wait, caplog: pytest.LogCaptureFixture
) -> None:
    @subscribe("it.proc.work", group="no-dlq", retry=fast_retry(2), dead_letter=False)
    async def handle(event: Work) -> None:
        raise RuntimeError("nope")

    async with App("it-proc-nodlq", broker=broker_url, handlers=[handle]) as app:
        await app.publish(Work(n=1))
        await waiter(lambda: app.stats()["no-dlq:it.proc.work"]["dropped"] == 1)
        assert await app.dead_letters.list() == []
    assert any("dropping message" in r.getMessage() for r in caplog.records)


# -- (e) soft timeout --------------------------------------------------------------------------


async def test_soft_timeout_cancels_and_counts_as_a_failure(broker_url: str, waiter: Wait) -> None:
    started: list[int] = []
    cancelled: list[int] = []

    @subscribe("it.proc.work", group="slow", timeout=0.05, retry=fast_retry(2))
    async def handle(event: Work, ctx: Context) -> None:
        started.append(ctx.attempt)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(ctx.attempt)
            raise

    async with App("it-proc-slow", broker=broker_url, handlers=[handle]) as app:
        await app.publish(Work(n=1), key="k")
        await waiter(lambda: app.stats()["slow:it.proc.work"]["dead_lettered"] == 1)
        (letter,) = await app.dead_letters.list()

    assert started == [1, 2]
    assert cancelled == [1, 2]
    assert letter.attempts == 2
    assert "HandlerTimeoutError" in letter.error
    assert "timeout" in letter.error


async def test_timeout_then_success_on_retry(broker_url: str, waiter: Wait) -> None:
    done: list[int] = []

    @subscribe("it.proc.work", group="slow-once", timeout=0.05, retry=fast_retry(3))
    async def handle(event: Work, ctx: Context) -> None:
        if ctx.attempt == 1:
            await asyncio.sleep(30)
        done.append(ctx.attempt)

    async with App("it-proc-slow-once", broker=broker_url, handlers=[handle]) as app:
        await app.publish(Work(n=1))
        await waiter(lambda: done == [2])
        await waiter(lambda: app.stats()["slow-once:it.proc.work"]["handled"] == 1)
        assert await app.dead_letters.list() == []


class _SkippableClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock a test moves forward: the timers due in the skipped time
    fire at once, so tens of seconds of loop time pass in milliseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0.0

    def time(self) -> float:
        """The loop's clock, ``skipped`` seconds ahead of the monotonic one."""
        return super().time() + self.skipped


def test_timeout_none_never_cancels(broker_url: str, waiter: Wait) -> None:
    """With ``timeout=None`` a handler runs past the default timeout without being
    cancelled; the same handler with the default timeout, given the same message in another
    group on the same clock, is cancelled meanwhile (the positive control)."""
    with asyncio.Runner(loop_factory=_SkippableClockLoop) as runner:
        runner.run(_run_past_the_default_timeout(broker_url, waiter))


async def _run_past_the_default_timeout(broker_url: str, wait_until: Wait) -> None:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, _SkippableClockLoop)
    release = asyncio.Event()
    started: dict[str, int] = defaultdict(int)
    cancelled: list[str] = []
    done: list[str] = []

    async def hold(group: str) -> None:
        started[group] += 1
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(group)
            raise
        done.append(group)

    @subscribe("it.proc.work", group="patient", timeout=None)
    async def patient(event: Work) -> None:
        await hold("patient")

    @subscribe("it.proc.work", group="default", retry=fast_retry(3))  # the default timeout
    async def default(event: Work) -> None:
        await hold("default")

    async with App("it-proc-patient", broker=broker_url, handlers=[patient, default]) as app:
        await app.publish(Work(n=3))
        await wait_until(lambda: started == {"patient": 1, "default": 1}, what="both handlers")
        # A second of loop time per step (the watchdog ticks at most once a second), until
        # the default timeout fires, and at most twice that long.
        while not cancelled and loop.skipped < 2 * DEFAULT_TIMEOUT:
            loop.skipped += 1.0
            await asyncio.sleep(0.001)
        assert cancelled == ["default"], f"cancelled after {loop.skipped}s: {cancelled}"
        assert loop.skipped >= DEFAULT_TIMEOUT  # both ran past the default timeout
        release.set()
        await wait_until(lambda: sorted(done) == ["default", "patient"], what="both done")
        assert started == {"patient": 1, "default": 2}
        stats = app.stats()
        assert (
            stats["patient:it.proc.work"]["handled"],
            stats["patient:it.proc.work"]["retries"],
        ) == (1, 0)
    assert cancelled == ["default"]


async def test_timeout_applies_to_each_call_not_to_a_run_of_calls(
    broker_url: str, waiter: Wait
) -> None:
    # One worker handles ten messages of one key back to back, each well within the
    # timeout but all together three times longer: the watchdog times each call apart.
    done: list[int] = []

    @subscribe("it.proc.work", group="steady", timeout=0.1, retry=fast_retry(1))
    async def handle(event: Work) -> None:
        await asyncio.sleep(0.03)
        done.append(event.n)

    async with App("it-proc-steady", broker=broker_url, handlers=[handle]) as app:
        for n in range(10):
            await app.publish(Work(n=n), key="one-key")
        await waiter(lambda: len(done) == 10)
        stats = app.stats()["steady:it.proc.work"]
        assert (stats["retries"], stats["dead_lettered"]) == (0, 0)
    assert done == list(range(10))


# -- (f) ctx.publish: correlation, causation, outbox -------------------------------------------


async def test_ctx_publish_continues_the_correlation(broker_url: str, waiter: Wait) -> None:
    effects: list[Envelope] = []

    @subscribe("it.proc.cause", group="causer")
    async def cause(event: Cause, ctx: Context) -> None:
        await ctx.publish(Effect(n=event.n), key=f"e{event.n}")

    @subscribe("it.proc.effect", group="observer")
    async def observe(env: Envelope) -> None:
        effects.append(env)

    async with App("it-proc-corr", broker=broker_url, handlers=[cause, observe]) as app:
        root = await app.publish(Cause(n=1), key="c1")
        joined = await app.publish(Cause(n=2), correlation_id="business-tx-9")
        await waiter(lambda: len(effects) == 2)

    by_n = {e.data["n"]: e for e in effects}
    first, second = by_n[1], by_n[2]
    assert root.correlation_id == root.id  # app.publish starts a correlation
    assert root.causation_id is None
    assert first.correlation_id == root.id  # inherited
    assert first.causation_id == root.id  # caused by the handled message
    assert first.id not in (root.id, joined.id)
    assert first.source == "it-proc-corr"
    assert first.key == "e1"
    assert first.type == "it.proc.effect"
    assert second.correlation_id == "business-tx-9"
    assert second.causation_id == joined.id
    # One business transaction is one trace: the child keeps the parent's trace id.
    assert first.headers["traceparent"].split("-")[1] == root.headers["traceparent"].split("-")[1]
    assert first.headers["traceparent"] != root.headers["traceparent"]


async def test_ctx_publish_to_an_explicit_topic(broker_url: str, waiter: Wait) -> None:
    got: list[Envelope] = []

    @subscribe("it.proc.cause", group="router")
    async def route(event: Cause, ctx: Context) -> None:
        out = await ctx.publish(Effect(n=event.n), topic="it.proc.routed.special")
        assert out.causation_id == ctx.envelope.id

    @subscribe("it.proc.routed.>", group="special")
    async def special(env: Envelope) -> None:
        got.append(env)

    async with App("it-proc-topic", broker=broker_url, handlers=[route, special]) as app:
        await app.publish(Cause(n=4))
        await waiter(lambda: len(got) == 1)
    assert got[0].type == "it.proc.effect"


async def test_nothing_is_published_from_a_failed_attempt(broker_url: str, waiter: Wait) -> None:
    effects: list[Effect] = []

    @subscribe("it.proc.cause", group="flaky-publisher", retry=fast_retry(3))
    async def cause(event: Cause, ctx: Context) -> None:
        await ctx.publish(Effect(n=event.n, attempt=ctx.attempt), key="fx")
        if event.n == 1 and ctx.attempt == 1:
            raise RuntimeError("fails after publishing")
        if event.n == 2:
            raise RuntimeError("always fails after publishing")

    @subscribe("it.proc.effect", group="effects")
    async def observe(event: Effect) -> None:
        effects.append(event)

    async with App("it-proc-outbox", broker=broker_url, handlers=[cause, observe]) as app:
        await app.publish(Cause(n=1))
        await app.publish(Cause(n=2))
        stats = app.stats
        await waiter(lambda: stats()["flaky-publisher:it.proc.cause"]["handled"] == 1)
        await waiter(lambda: stats()["flaky-publisher:it.proc.cause"]["dead_lettered"] == 1)
        # Everything the handler sent precedes this marker on the same key.
        await app.publish(Effect(n=99), key="fx")
        await waiter(lambda: any(e.n == 99 for e in effects))

    assert [(e.n, e.attempt) for e in effects] == [(1, 2), (99, 0)]


# -- (g) live right after start ----------------------------------------------------------------


async def test_message_published_right_after_start_reaches_every_group(
    broker_name: str, waiter: Wait
) -> None:
    # Repeated on fresh brokers: a race between joining and publishing would show sometimes.
    for round_ in range(20):
        got = await _publish_right_after_start(f"memory://{broker_name}-{round_}", waiter)
        assert got == {"g-exact": 1, "g-star": 1, "g-tail": 1, "g-other": 1}


async def _publish_right_after_start(url: str, waiter: Wait) -> dict[str, int]:
    got: dict[str, int] = defaultdict(int)

    def handler_for(group: str, pattern: str) -> object:
        async def handle(env: Envelope) -> None:
            got[group] += 1

        handle.__qualname__ = f"handle_{group}"
        return subscribe(pattern, group=group)(handle)

    handlers = [
        handler_for("g-exact", "it.proc.other"),
        handler_for("g-star", "it.proc.*"),
        handler_for("g-tail", "it.>"),
        handler_for("g-other", "it.proc.other"),
    ]
    async with App("it-proc-live", broker=url, handlers=handlers) as app:
        await app.publish(Other(text="first"))
        await waiter(lambda: len(got) == 4, what="every group")
    return dict(got)


async def test_two_apps_share_a_broker_url(broker_url: str, waiter: Wait) -> None:
    got: list[str] = []

    @subscribe("it.proc.other", group="consumer-app")
    async def handle(event: Other) -> None:
        got.append(event.text)

    consumer = App("it-proc-consumer", broker=broker_url, handlers=[handle])
    producer = App("it-proc-producer", broker=broker_url)
    async with consumer, producer:
        env = await producer.publish(Other(text="hello"))
        await waiter(lambda: got == ["hello"])
    assert env.source == "it-proc-producer"


class RecordingBroker(MemoryBroker):
    """A memory broker that remembers the (topic, key) of every publish."""

    def __init__(self, name: str) -> None:
        super().__init__(MemoryBrokerConfig(name=name))
        self.sent: list[tuple[str, str | None]] = []
        self.headers: list[Mapping[str, str] | None] = []

    async def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.sent.append((topic, key))
        self.headers.append(headers)
        await super().publish(topic, payload, key=key, headers=headers)


async def test_publish_uses_the_key_and_topic(broker_name: str) -> None:
    broker = RecordingBroker(broker_name)
    async with App("it-proc-keys", broker=broker) as app:
        await app.publish(Other(text="a"), key="k-1")
        await app.publish(Other(text="b"), topic="it.proc.elsewhere")
        env = Envelope.create("it.proc.other", {"text": "c"}, key="k-env")
        await app.publish(env)
    assert broker.sent == [
        ("it.proc.other", "k-1"),
        ("it.proc.elsewhere", None),
        ("it.proc.other", "k-env"),
    ]


async def test_the_id_header_goes_with_every_message(broker_name: str, waiter: Wait) -> None:
    broker = RecordingBroker(broker_name)
    sent: list[Envelope] = []

    @subscribe("it.proc.cause", group="ids")
    async def handle(event: Cause, ctx: Context) -> None:
        sent.append(await ctx.publish(Effect(n=event.n)))

    async with App("it-proc-ids", broker=broker, handlers=[handle]) as app:
        env = await app.publish(Cause(n=1))
        await waiter(lambda: len(broker.headers) == 2)
    assert broker.headers == [{"eventflow-id": e.id} for e in (env, *sent)]


async def test_publish_envelope_with_key_is_not_silently_ignored(broker_name: str) -> None:
    broker = RecordingBroker(broker_name)
    async with App("it-proc-envkey", broker=broker) as app:
        env = Envelope.create("it.proc.other", {"text": "x"})
        try:
            await app.publish(env, key="wanted")
        except ConfigurationError:
            return  # refusing is fine too
    assert broker.sent == [("it.proc.other", "wanted")]


# -- handler shapes ----------------------------------------------------------------------------


async def test_union_envelope_and_any_event_handlers(broker_url: str, waiter: Wait) -> None:
    union_got: list[object] = []
    any_got: list[object] = []

    @subscribe("it.proc.*", group="union")
    async def by_union(event: Other | Work) -> None:
        union_got.append(event)

    @subscribe("it.proc.*", group="anything")
    async def by_any(event: Event, ctx: Context) -> None:
        any_got.append(event)

    async with App("it-proc-shapes", broker=broker_url, handlers=[by_union, by_any]) as app:
        await app.publish(Other(text="o"), key="k")
        await app.publish(Work(n=1), key="k")
        await waiter(lambda: len(union_got) == 2 and len(any_got) == 2)
    assert union_got == [Other(text="o"), Work(n=1)]
    assert any_got == [Other(text="o"), Work(n=1)]


async def test_context_fields(broker_url: str, waiter: Wait) -> None:
    seen: list[tuple[str, int, str, bool]] = []

    @subscribe("it.proc.other", group="ctx-group")
    async def handle(event: Other, ctx: Context) -> None:
        seen.append((ctx.group, ctx.attempt, ctx.envelope.type, ctx.app is app))

    app = App("it-proc-ctx", broker=broker_url, handlers=[handle])
    async with app:
        await app.publish(Other(text="x"))
        await waiter(lambda: len(seen) == 1)
    assert seen == [("ctx-group", 1, "it.proc.other", True)]


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_timeout_after_a_handlers_task_group_failed_is_still_a_timeout(
    concurrency: int, broker_url: str, waiter: Callable[..., Awaitable[None]]
) -> None:
    """A handler's task group whose child failed after the group's body ended leaves a
    cancel request counted on the worker's task (Python 3.11). The watchdog's next timeout
    on that worker is still a timeout (retried), not taken for a shutdown that ends the
    worker and leaves the subscription without one."""
    attempts: list[int] = []

    @subscribe(
        "it.proc.tg",
        group="g",
        concurrency=concurrency,
        timeout=0.2,
        retry=RetryPolicy(3, initial_delay=0.01),
    )
    async def handle(env: Envelope, ctx: Context) -> None:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            async with asyncio.TaskGroup() as tg:

                async def child() -> None:
                    await asyncio.sleep(0.01)
                    raise ValueError("a child fails after the body")

                tg.create_task(child())
        elif ctx.attempt == 2:
            await asyncio.sleep(5)  # past the timeout: the watchdog cancels it

    app = App("it-proc-tg", broker=broker_url, handlers=[handle])
    async with app:
        await app.broker.publish("it.proc.tg", Envelope.create("it.proc.tg", {}).to_bytes())
        await waiter(lambda: app.stats()["g:it.proc.tg"]["handled"] == 1, timeout=10)
        assert attempts == [1, 2, 3]
        await app.broker.publish("it.proc.tg", Envelope.create("it.proc.tg", {}).to_bytes())
        await waiter(lambda: app.stats()["g:it.proc.tg"]["handled"] == 2, timeout=10)
