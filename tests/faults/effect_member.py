"""An app in a child process for the crash tests: applies one effect per message in
PostgreSQL through ``ctx.transaction()`` (the transactional inbox), and is killed.

    PYTHONPATH=.:tests python tests/faults/effect_member.py BROKER_URL STORE_URL TOPIC GROUP
        [--max-deliveries N]

Each handled message inserts ``(message id, n)`` into ``fx_effects`` (no unique key there:
only eventflow's inbox keeps a row from being written twice). A message whose data has
``"poison": true`` makes the process die (``os._exit``), as a segfault or an OOM kill would.
Prints ``ready`` once its subscriptions are live; SIGTERM stops it gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from eventflow import App, Context, Envelope, RetryPolicy, subscribe
from faults.children import serve


async def main() -> None:
    """Run until SIGTERM (graceful) or death."""
    parser = argparse.ArgumentParser()
    parser.add_argument("broker")
    parser.add_argument("store")
    parser.add_argument("topic")
    parser.add_argument("group")
    parser.add_argument("--max-deliveries", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("FX_LOG_LEVEL", "WARNING"))

    @subscribe(
        args.topic,
        group=args.group,
        concurrency=4,
        retry=RetryPolicy(3, initial_delay=0.01, max_delay=0.05),
        max_deliveries=args.max_deliveries,
    )
    async def apply(env: Envelope, ctx: Context) -> None:
        if env.data.get("poison"):
            # Dies after a moment of work: a Kafka member carries delivery counts in commits
            # made every commit_interval, and a kill within one may go uncounted.
            await asyncio.sleep(0.3)
            os._exit(17)
        await asyncio.sleep(0.002)  # some work, so a kill finds handlers in flight
        async with ctx.transaction() as tx:
            await tx.execute(
                "INSERT INTO fx_effects (message_id, n) VALUES ($1, $2)", env.id, env.data["n"]
            )

    app = App(
        "effect-member",
        broker=args.broker,
        store=args.store,
        handlers=[apply],
        heartbeat_interval=0.2,  # the test reads the members' counters from the heartbeats
    )
    await serve(app)


if __name__ == "__main__":
    asyncio.run(main())
