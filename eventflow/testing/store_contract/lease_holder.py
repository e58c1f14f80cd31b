"""A process that holds a lease and writes under it, for the store contract's lease-loss
cases (a holder paused past its ttl, a holder killed while it holds).

``python -m eventflow.testing.store_contract.lease_holder SOURCE NAME CHECKPOINT INTERVAL``:
``SOURCE`` is Python code defining ``make_store()`` (the adapter's test module writes it:
the store, on the test's backend, with the test's lease ttl). The process holds the lease
``NAME`` and sets the checkpoint ``CHECKPOINT`` to 1, 2, 3, ... with the lease, every
``INTERVAL`` seconds; when the lease is lost it tries one more write with the lost lease,
then waits for the lease again; it runs until killed. It reports each step as a JSON line
on stdout:

- ``{"event": "held", "epoch": E, "owner": O}`` once it holds the lease;
- ``{"event": "wrote", "n": N, "epoch": E}`` after each write under it;
- ``{"event": "lost", "epoch": E, "why": ...}`` when its block ended with ``LeaseLostError``;
- ``{"event": "refused", "epoch": E}`` or ``{"event": "stale-written", "epoch": E}``: what
  the store did with the write made with the lost lease (``-N``);
- ``{"event": "error", "why": ...}`` when the store failed otherwise (it tries again).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import orjson

from ...errors import LeaseLostError, StoreError
from ...ports import Store

__all__ = ["hold_and_write", "main"]


def _report(event: str, **fields: Any) -> None:
    sys.stdout.write(orjson.dumps({"event": event, **fields}).decode() + "\n")
    sys.stdout.flush()


async def hold_and_write(store: Store, name: str, checkpoint: str, interval: float) -> None:
    """Hold ``name`` and write ``checkpoint`` under it for ever, reporting on stdout."""
    written = 0
    while True:
        lease = None
        try:
            async with store.leases.hold(name) as lease:
                _report("held", epoch=lease.epoch, owner=lease.owner)
                while True:
                    await store.checkpoints.set(checkpoint, written + 1, lease=lease)
                    written += 1
                    _report("wrote", n=written, epoch=lease.epoch)
                    await asyncio.sleep(interval)
        except LeaseLostError as exc:
            assert lease is not None
            _report("lost", epoch=lease.epoch, why=str(exc))
            try:
                await store.checkpoints.set(checkpoint, -written, lease=lease)
            except LeaseLostError:
                _report("refused", epoch=lease.epoch)
            else:
                _report("stale-written", epoch=lease.epoch)
        except StoreError as exc:
            _report("error", why=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(interval)


async def _run(source: str, name: str, checkpoint: str, interval: float) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<make_store>", "exec"), namespace)
    store: Store = namespace["make_store"]()
    await store.open()
    try:
        await hold_and_write(store, name, checkpoint, interval)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    """Run the holder (see the module docstring)."""
    source, name, checkpoint, interval = argv or sys.argv[1:]
    asyncio.run(_run(source, name, checkpoint, float(interval)))


if __name__ == "__main__":
    main()
