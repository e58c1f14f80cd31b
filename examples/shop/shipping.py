"""The shipping service: ships an order after a delay, and sometimes too late.

    eventflow run examples.shop.shipping:app [--port 9464]

A shipment takes ``SHOP_SHIP_DELAY`` seconds; a share ``SHOP_SHIP_LATE`` of orders (chosen
by a hash of the order id, so a run is reproducible) takes twice the saga's
ship timeout instead. The saga then times the step out and, the step being past the pivot,
sends it again (a new command); the late reply still arrives and completes the step. The
order is shipped once whatever the attempts: a shipment is an event stream per order
(``shipment-<order id>``, created with ``expected_version=0``), and a command for an order
already shipped is answered with that shipment.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from typing import Any

from eventflow import App, Context, subscribe

from .events import OrderShipped, ShipmentDispatched, ShipOrder
from .settings import Settings, settings

__all__ = ["GROUP", "create_app", "is_late"]

log = logging.getLogger("shop.shipping")

GROUP = "shop-shipping"


def is_late(order_id: str, share: float) -> bool:
    """Whether this order's shipment is one of the late ones (a stable choice per id)."""
    digest = hashlib.sha256(order_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < share


def create_app(config: Settings = settings, **options: Any) -> App:
    """The shipping ``App``: delays and the share of late shipments from ``config``."""
    delay, late_delay, share = config.ship_delay, config.ship_timeout * 2, config.ship_late

    @subscribe(
        "shop.shipping.ship",
        group=GROUP,
        concurrency=32,
        retry=5,
        timeout=late_delay + 10.0,
    )
    async def ship(cmd: ShipOrder, ctx: Context) -> None:
        """Ship the order once; answer every attempt with the one shipment."""
        stream = f"shipment-{cmd.order_id}"
        async for rec in ctx.store.read_stream(stream, limit=1):
            done = rec.event
            assert isinstance(done, ShipmentDispatched)
            await ctx.publish(
                OrderShipped(order_id=done.order_id, shipment_id=done.shipment_id, lines=done.lines)
            )
            return
        late = is_late(cmd.order_id, share)
        await asyncio.sleep(late_delay if late else delay)  # the carrier at work
        if late:
            log.info("order %s shipped late (%.2fs)", cmd.order_id, late_delay)
        shipment = ShipmentDispatched(
            order_id=cmd.order_id,
            shipment_id=f"sh_{uuid.uuid4().hex[:12]}",
            lines=cmd.lines,
            late=late,
        )
        async with ctx.transaction():
            # expected_version=0: a second shipment of the order conflicts (ConcurrencyError),
            # and the retry of this attempt answers with the first one.
            await ctx.store.append(stream, [shipment], expected_version=0)
            shipped = OrderShipped(
                order_id=cmd.order_id, shipment_id=shipment.shipment_id, lines=cmd.lines
            )
            await ctx.publish(shipped)

    return App(
        "shop-shipping",
        broker=config.broker,
        store=config.store_for("shipping"),
        handlers=[ship],
        metrics=config.metrics or None,
        **options,
    )


app = create_app()
"""The shipping service of this process (``eventflow run examples.shop.shipping:app``)."""
