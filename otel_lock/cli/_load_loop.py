"""A steady, contended load on the demo replicas, so dashboards always have something to show.

Workers buy from a few hot products spread over every replica (the stock lock
is contended across processes), check out carts of two or three of them named
in any order (one lock per product, the same keys), export their orders
(a semaphore of two permits per user), restock a product when it sells out,
and submit orders with Idempotency-Keys: fresh ones, retries of the same request
(replayed), reused keys with another body (422 mismatch), concurrent
duplicates (409 conflict) and, now and then, a missing or ill-formed key
(400). Used by the compose stack's `loadgen` service and by
`otel-lock stack --load`.

    python -m otel_lock.cli._load_loop --target http://127.0.0.1:8001 --target http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import signal
import uuid
from typing import Any

import httpx

HOT_PRODUCTS = ("1001", "1002", "1003")
RESTOCK = 200


class LoadLoop:
    """Runs `workers` buyers until `stop()`; `requests` counts answers by status."""

    def __init__(self, targets: list[str], *, workers: int = 8, pause: float = 0.02,
                 products: tuple[str, ...] = HOT_PRODUCTS, seed: int | None = None) -> None:
        if not targets:
            raise ValueError("the load loop needs at least one --target URL")
        self.targets = targets
        self.workers = workers
        self.pause = pause  # pacing between a worker's requests, not synchronisation
        self.products = products
        self.random = random.Random(seed)
        self.requests: dict[int, int] = {}
        self._stopped = asyncio.Event()
        self._next_target = itertools.cycle(targets)

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            for product in self.products:
                await self._call(client, "PUT", f"/api/stock/{product}", json={"stock": RESTOCK})
            await asyncio.gather(*(self._worker(client, n) for n in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient, number: int) -> None:
        user = f"load-user-{number}"
        while not self._stopped.is_set():
            roll = self.random.random()
            if roll < 0.55:
                await self._buy(client)
            elif roll < 0.7:
                await self._checkout(client)
            elif roll < 0.75:
                await self._call(client, "POST", "/api/exports", headers={"X-User-Id": user})
            elif roll < 0.95:
                await self._order(client, user)
            else:
                await self._bad_order(client, user)
            try:
                await asyncio.wait_for(self._stopped.wait(), self.pause)
            except TimeoutError:
                pass

    async def _buy(self, client: httpx.AsyncClient) -> None:
        product = self.random.choice(self.products)
        response = await self._call(client, "POST", f"/api/stock/{product}/deduct", json={"quantity": 1})
        if response is not None and response.status_code == 409 and "out-of-stock" in response.text:
            await self._call(client, "PUT", f"/api/stock/{product}", json={"stock": RESTOCK})

    async def _checkout(self, client: httpx.AsyncClient) -> None:
        """A cart of two or three hot products in a random order: the checkout locks them in one order."""
        cart = self.random.sample(self.products, min(len(self.products), self.random.choice((2, 3))))
        body = {"items": [{"sku": product, "quantity": 1} for product in cart]}
        response = await self._call(client, "POST", "/api/checkout", json=body)
        if response is not None and response.status_code == 409 and "out-of-stock" in response.text:
            for product in cart:
                await self._call(client, "PUT", f"/api/stock/{product}", json={"stock": RESTOCK})

    async def _order(self, client: httpx.AsyncClient, user: str) -> None:
        key = f'"{uuid.uuid4().hex}"'
        product = self.random.choice(self.products)
        headers = {"Idempotency-Key": key, "X-User-Id": user}
        body = {"product_id": product, "quantity": 1}
        roll = self.random.random()
        if roll < 0.3:
            # A double submit: both at once (one stored, one 409 conflict or replayed).
            await asyncio.gather(self._call(client, "POST", "/api/orders", json=body, headers=headers),
                                 self._call(client, "POST", "/api/orders", json=body, headers=headers))
            return
        await self._call(client, "POST", "/api/orders", json=body, headers=headers)
        if roll < 0.6:  # the client retries: the stored answer is replayed
            await self._call(client, "POST", "/api/orders", json=body, headers=headers)
        elif roll < 0.7:  # the same key for another request: 422
            await self._call(client, "POST", "/api/orders", json={**body, "quantity": 2}, headers=headers)

    async def _bad_order(self, client: httpx.AsyncClient, user: str) -> None:
        body = {"product_id": self.random.choice(self.products), "quantity": 1}
        headers = {"X-User-Id": user}
        if self.random.random() < 0.5:
            headers["Idempotency-Key"] = "not an sf-string"
        await self._call(client, "POST", "/api/orders", json=body, headers=headers)

    async def _call(self, client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        try:
            response = await client.request(method, next(self._next_target) + path, **kwargs)
        except httpx.TransportError:
            # A replica restarting is part of the show, not a reason to stop.
            self.requests[0] = self.requests.get(0, 0) + 1
            return None
        self.requests[response.status_code] = self.requests.get(response.status_code, 0) + 1
        return response


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otel_lock.cli._load_loop", description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", required=True, help="replica base URL (repeat)")
    parser.add_argument("--workers", type=int, default=8, help="concurrent buyers (default: %(default)s)")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between a worker's requests")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.pause < 0:
        parser.error("--workers must be >= 1 and --pause >= 0")

    async def run() -> None:
        loop = LoadLoop(args.target, workers=args.workers, pause=args.pause)
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, loop.stop)
        await loop.run()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
