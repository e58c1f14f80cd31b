"""A group member in its own process for the hard-timeout test: its handler either blocks
the event loop (``time.sleep``) or handles the message.

    PYTHONPATH=.:tests python tests/faults/hanging_member.py BROKER_URL GROUP MODE OUTFILE LOGFILE

MODE ``hang``: the handler writes ``started <n>`` to OUTFILE and calls ``time.sleep(60)``,
past ``hard_timeout`` (2 s, soft ``timeout`` 0.5 s): the app must log the stack to LOGFILE
and exit with status 70. MODE ``work``: the handler writes ``handled <n> <attempt>
<delivery>`` to OUTFILE. Prints ``ready`` once its subscription is live; SIGTERM stops it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import TextIO

from eventflow import App, Context, Event, subscribe
from faults.children import serve


class HangJob(Event, type="faults.hang.job"):
    """A job; the hanging member blocks on it."""

    n: int


async def main(broker: str, group: str, mode: str, out: TextIO) -> None:
    """Run the member until SIGTERM (``work``) or its hard timeout (``hang``)."""

    @subscribe("faults.hang.job", group=group, timeout=0.5, hard_timeout=2.0)
    async def job(event: HangJob, ctx: Context) -> None:
        if mode == "hang":
            out.write(f"started {event.n}\n")
            time.sleep(60)  # noqa: ASYNC251 - the blocking call the hard timeout ends
        out.write(f"handled {event.n} {ctx.attempt}\n")

    await serve(App(f"hang-{mode}", broker=broker, handlers=[job]))


if __name__ == "__main__":
    broker_url, group_name, member_mode, out_path, log_path = sys.argv[1:6]
    logging.basicConfig(filename=log_path, level=logging.WARNING)
    with open(out_path, "a", buffering=1) as out_file:  # line-buffered: one write per line
        asyncio.run(main(broker_url, group_name, member_mode, out_file))
