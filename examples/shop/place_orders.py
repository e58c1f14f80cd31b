"""Run both shop services in this process, place some orders and print what became of them.

    python -m examples.shop.place_orders --orders 40

Both apps use the ``memory://`` broker, which lives inside one process, so they run side
by side here; with a network broker each would run in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections import Counter

from . import inventory, orders


async def main(count: int) -> None:
    async with inventory.app, orders.app:  # both subscribed before the first order
        skus = itertools.cycle(sorted(inventory.STOCK))
        for n in range(1, count + 1):
            await orders.place_order(f"order-{n}", next(skus), qty=1 + n % 4)
        await orders.wait_settled()
    outcome = Counter(orders.ORDERS.values())
    print(
        f"placed {count} orders: {outcome['confirmed']} confirmed, {outcome['rejected']} rejected"
    )
    print("stock left:", ", ".join(f"{sku}={n}" for sku, n in sorted(inventory.STOCK.items())))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--orders", type=int, default=40)
    asyncio.run(main(parser.parse_args().orders))
