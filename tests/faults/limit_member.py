"""An app instance that calls the test's HTTP service inside a cluster limit.

    python tests/faults/limit_member.py BROKER STORE SERVICE CONFIG

CONFIG is a JSON object: ``topic``, ``group``, ``concurrency`` (the handler's), ``limit``
(keyword arguments of ``Limit("api", ...)``, ``scope="cluster"`` implied) and ``path``
(``/call`` or ``/hang``). The handler, for each message, takes ``ctx.limit("api")`` and
GETs SERVICE + path with the message's ``n`` and the wall time the request began
(``began``); a non-2xx answer raises. Prints ``ready`` once the app is live; runs until
SIGTERM (or SIGKILL).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

from eventflow import App, Context, Envelope, Limit, subscribe
from faults.children import serve


async def main(broker: str, store: str, service: str, raw: str) -> None:
    """Run the member."""
    config = json.loads(raw)
    path = config.get("path", "/call")
    async with httpx.AsyncClient(base_url=service, timeout=30.0) as client:

        @subscribe(
            config["topic"], group=config["group"], concurrency=config["concurrency"], timeout=60
        )
        async def call(env: Envelope, ctx: Context) -> None:
            assert isinstance(env.data, dict)
            async with ctx.limit("api"):
                # when the request began, on this machine's wall clock (the service, in a
                # process a loaded machine may pause, would see it some time later)
                began = repr(time.time())
                answer = await client.get(path, params={"n": str(env.data["n"]), "began": began})
                answer.raise_for_status()

        limit = Limit("api", scope="cluster", **config["limit"])
        app = App("limit-member", broker=broker, store=store, handlers=[call], limits=[limit])
        await serve(app)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
