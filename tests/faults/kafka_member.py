"""A group member in a child process, for the Kafka fault tests (killed, crashed, stopped).

    PYTHONPATH=.:tests python tests/faults/kafka_member.py URL TOPIC GROUP OUT [--slow S]
        [--store URL] [--max-attempts N] [--max-deliveries N] [--crash-on-poison]

Handles envelopes of TOPIC in GROUP, appending ``<envelope id> <attempt> <key>`` to OUT (one
write per line, so a SIGKILL loses no line already handled). Prints ``ready`` once its
subscription is live. ``--crash-on-poison`` makes the process die (``os._exit``) on an
envelope whose data has ``"poison": true``, after ``--slow`` seconds, as a segfault would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from eventflow import App, Context, Envelope, RetryPolicy, subscribe
from eventflow.adapters.kafka import KafkaBroker
from faults.children import serve


async def main() -> None:
    """Run the member until SIGTERM (graceful) or death."""
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("topic")
    parser.add_argument("group")
    parser.add_argument("out")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--store", default="memory://")
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--max-deliveries", type=int, default=10)
    parser.add_argument("--crash-on-poison", action="store_true")
    args = parser.parse_args()
    out = open(args.out, "a", buffering=1)  # noqa: SIM115, ASYNC230 - one write(2) per line

    policy = RetryPolicy(max_attempts=args.max_attempts, initial_delay=0.01, max_delay=0.05)

    @subscribe(
        args.topic,
        group=args.group,
        concurrency=4,
        retry=policy,
        max_deliveries=args.max_deliveries,
    )
    async def handle(env: Envelope, ctx: Context) -> None:
        if args.slow:
            await asyncio.sleep(args.slow)
        out.write(f"{env.id} {ctx.attempt} {env.key}\n")
        if args.crash_on_poison and isinstance(env.data, dict) and env.data.get("poison"):
            os._exit(17)

    app = App(
        "kafka-member",
        broker=KafkaBroker.from_url(args.url),
        store=args.store,
        handlers=[handle],
        grace_period=5.0,
    )
    await serve(app)
    out.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
