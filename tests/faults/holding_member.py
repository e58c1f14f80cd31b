"""A group member that holds its messages, in its own process, for the failover tests.

    python tests/faults/holding_member.py BROKER_URL TOPIC GROUP OUT

An ``App`` on BROKER_URL (``nats://...?stream=S`` or ``kafka://...``, with the adapter's
default settings otherwise) whose handler, in GROUP on TOPIC with ``concurrency=4``, appends
``<key> <n>`` to OUT (one write per line) and then never returns, as a stuck handler would:
everything the member fetched stays unacked until it is killed. Prints ``ready`` once its
subscription is live.
"""

from __future__ import annotations

import asyncio
import sys

from eventflow import App, Context, Envelope, subscribe


async def main(url: str, topic: str, group: str, path: str) -> None:
    """Run the member until it is killed."""
    out = open(path, "a", buffering=1)  # noqa: SIM115, ASYNC230 - one write(2) per line

    @subscribe(topic, group=group, concurrency=4, timeout=600.0)
    async def hold(env: Envelope, ctx: Context) -> None:
        assert isinstance(env.data, dict)
        out.write(f"{env.key} {env.data['n']}\n")
        await asyncio.Event().wait()

    async with App("holding-member", broker=url, handlers=[hold]):
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
