"""A process that holds a lease and writes under it, for the store contract's lease-loss
cases (a holder paused past its ttl, a holder killed while it holds).

``python -m eventflow.testing.store_contract.lease_holder SOURCE NAME CHECKPOINT INTERVAL
[MODE]``: ``SOURCE`` is Python code defining ``make_store()`` (the adapter's test module
writes it: the store, on the test's backend, with the test's lease ttl). The process holds
the lease ``NAME`` and sets the checkpoint ``CHECKPOINT`` to 1, 2, 3, ... under the lease,
every ``INTERVAL`` seconds; when the lease is lost it tries one more write with the lost
lease, then waits for the lease again; it runs until killed. ``MODE`` says how a write is
made under the lease: ``write`` (the default) passes it to the write
(``checkpoints.set(..., lease=lease)``), ``fence`` makes the write in a transaction fenced
by it (``leases.fence(lease, tx)``, then ``checkpoints.set(..., tx=tx)``). It reports each
step as a JSON line on stdout:

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
from ...leases import Lease
from ...ports import Store

__all__ = ["MODES", "hold_and_write", "main"]


def _report(event: str, **fields: Any) -> None:
    sys.stdout.write(orjson.dumps({"event": event, **fields}).decode() + "\n")
    sys.stdout.flush()


MODES = ("write", "fence")
"""How the holder makes its writes under the lease (see the module docstring)."""


async def _write(store: Store, checkpoint: str, n: int, lease: Lease, mode: str) -> None:
    if mode == "write":
        await store.checkpoints.set(checkpoint, n, lease=lease)
        return
    async with store.transaction() as tx:
        await store.leases.fence(lease, tx)
        await store.checkpoints.set(checkpoint, n, tx=tx)


async def hold_and_write(
    store: Store, name: str, checkpoint: str, interval: float, mode: str = "write"
) -> None:
    """Hold ``name`` and write ``checkpoint`` under it for ever, reporting on stdout."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    written = 0
    while True:
        lease = None
        try:
            async with store.leases.hold(name) as lease:
                _report("held", epoch=lease.epoch, owner=lease.owner)
                while True:
                    await _write(store, checkpoint, written + 1, lease, mode)
                    written += 1
                    _report("wrote", n=written, epoch=lease.epoch)
                    await asyncio.sleep(interval)
        except LeaseLostError as exc:
            assert lease is not None
            _report("lost", epoch=lease.epoch, why=str(exc))
            try:
                await _write(store, checkpoint, -written, lease, mode)
            except LeaseLostError:
                _report("refused", epoch=lease.epoch)
            else:
                _report("stale-written", epoch=lease.epoch)
        except StoreError as exc:
            _report("error", why=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(interval)


async def _run(source: str, name: str, checkpoint: str, interval: float, mode: str) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(source, "<make_store>", "exec"), namespace)
    store: Store = namespace["make_store"]()
    await store.open()
    try:
        await hold_and_write(store, name, checkpoint, interval, mode)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    """Run the holder (see the module docstring)."""
    source, name, checkpoint, interval, *rest = argv or sys.argv[1:]
    asyncio.run(_run(source, name, checkpoint, float(interval), rest[0] if rest else "write"))


if __name__ == "__main__":
    main()
