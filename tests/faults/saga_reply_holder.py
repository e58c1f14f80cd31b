"""A member of a saga's consumer group that takes replies and never finishes them.

    PYTHONPATH=.:tests python tests/faults/saga_reply_holder.py BROKER_URL TOPIC GROUP OUT

An ``App`` on BROKER_URL whose one handler, in GROUP (a saga's group, ``saga.<name>``) on
TOPIC (a reply type of that saga), appends the key of each message it gets to OUT (one
write per line) and then never returns, as a stalled process would: what it took stays
unhandled (on Kafka, its partitions' offsets uncommitted) until it is killed. Prints
``ready`` once its subscription is live (``faults.children.serve``).
"""

from __future__ import annotations

import asyncio
import sys

from eventflow import App, Context, Envelope, subscribe
from faults.children import serve


async def main(url: str, topic: str, group: str, path: str) -> None:
    """Run the member until it is killed (or SIGTERM)."""
    out = open(path, "a", buffering=1)  # noqa: SIM115, ASYNC230 - one write(2) per line

    @subscribe(topic, group=group, concurrency=64, timeout=600.0)
    async def hold(env: Envelope, ctx: Context) -> None:
        out.write(f"{env.key}\n")
        await asyncio.Event().wait()

    await serve(App("saga-reply-holder", broker=url, handlers=[hold], grace_period=0.1))
    out.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
