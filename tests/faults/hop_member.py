"""One side of a ping-pong in its own process, for the hop-latency fault test (SIGKILLed).

    PYTHONPATH=.:tests python tests/faults/hop_member.py SIDE BROKER_URL STORE_URL

Two of these bounce a :class:`Ball` between them: side ``a`` handles ``hops.ball.a`` and
answers with ``ctx.publish`` outside a transaction; side ``b`` handles ``hops.ball.b`` and
answers inside ``ctx.transaction()`` (the transactional outbox). Each handling prints
``hop RALLY N MS`` on stdout, ``MS`` being the milliseconds since the ball was published
(the envelope's time: the same clock, one machine); the ball stops at ``limit`` (``done
RALLY``). A handler waits ``pause`` seconds before answering, so a rally can space its
hops the way ordinary traffic does. Prints ``ready`` once its subscription is live;
SIGTERM stops it gracefully.
"""

from __future__ import annotations

import asyncio
import sys
import time

from eventflow import App, Context, Event, subscribe
from faults.children import serve


class Ball(Event, type="hops.ball.a"):
    """The ball on its way to side ``a``."""

    rally: str
    n: int
    limit: int
    pause: float = 0.0


class BallB(Ball, type="hops.ball.b"):
    """The ball on its way to side ``b``."""


def _report(ball: Ball, ctx: Context) -> bool:
    """Print the hop; whether the rally goes on."""
    ms = (time.time() - ctx.envelope.time.timestamp()) * 1000
    print(f"hop {ball.rally} {ball.n} {ms:.3f}", flush=True)
    if ball.n >= ball.limit:
        print(f"done {ball.rally}", flush=True)
        return False
    return True


def _next(ball: Ball, kind: type[Ball]) -> Ball:
    return kind(rally=ball.rally, n=ball.n + 1, limit=ball.limit, pause=ball.pause)


@subscribe("hops.ball.a", group="hops-a")
async def side_a(ball: Ball, ctx: Context) -> None:
    """Answer with a plain ``ctx.publish`` (sent once the handler returned)."""
    if _report(ball, ctx):
        await asyncio.sleep(ball.pause)
        await ctx.publish(_next(ball, BallB))


@subscribe("hops.ball.b", group="hops-b")
async def side_b(ball: BallB, ctx: Context) -> None:
    """Answer inside the handling's transaction (the outbox relay sends it)."""
    if _report(ball, ctx):
        await asyncio.sleep(ball.pause)
        async with ctx.transaction():
            await ctx.publish(_next(ball, Ball))


async def main(side: str, broker: str, store: str) -> None:
    """Run side ``side`` until SIGTERM."""
    handler = side_a if side == "a" else side_b
    await serve(App(f"hops-{side}", broker=broker, store=store, handlers=[handler]))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
