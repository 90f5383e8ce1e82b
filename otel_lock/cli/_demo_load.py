"""The bursts of `otel-lock demo`: a seckill, a multi-product checkout and a double submit.

Buyers are spread round-robin over the replicas, so the lock has to work
across processes, not just inside one event loop. The bursts return plain
counts; judging them (oversell, duplicates) is the caller's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import ssl
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol, Sequence

import httpx

RETRYABLE = {"lock-timeout", "stale-fencing-token", "redis-unavailable"}
MAX_ATTEMPTS = 20


BUYERS_PER_CLIENT = 8


def cache_missing_sniffio() -> None:
    """httpcore tries `import sniffio` on every request step; when it is not installed each
    failed import scans sys.path (~0.5 ms, ten times per request). Caching the miss in
    sys.modules makes it instant and changes nothing else: the import still fails."""
    if "sniffio" not in sys.modules and importlib.util.find_spec("sniffio") is None:
        sys.modules["sniffio"] = None  # type: ignore[assignment]


@contextlib.asynccontextmanager
async def clients(concurrency: int, timeout: float = 30.0) -> AsyncIterator[list[httpx.AsyncClient]]:
    """Several small clients instead of one big one.

    httpx's connection pool scans all its connections on every request, so
    200 concurrent requests on one client spend more time in the pool than
    on the wire (measured: ~3x slower than 25 clients of 8). Real buyers are
    separate clients anyway. One SSL context is shared: building one per
    client costs milliseconds each.
    """
    context = ssl.create_default_context()
    count = max(1, min(50, -(-concurrency // BUYERS_PER_CLIENT)))
    pool = [httpx.AsyncClient(timeout=timeout, verify=context) for _ in range(count)]
    try:
        yield pool
    finally:
        for client in pool:
            await client.aclose()


def _pick(pool: "httpx.AsyncClient | Sequence[httpx.AsyncClient]", index: int) -> httpx.AsyncClient:
    if isinstance(pool, httpx.AsyncClient):
        return pool
    return pool[index % len(pool)]


def problem_type(response: httpx.Response) -> str:
    """The case name of a problem+json answer ('' if the body is not one)."""
    try:
        return str(response.json().get("type", "")).rsplit("/", 1)[-1]
    except (ValueError, AttributeError):
        return ""


def retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", "1")), 1.0)
    except ValueError:
        return 1.0


class _Tally(Protocol):
    """What a burst counts of the answers that are not a sale."""

    out_of_stock: int
    retries: Counter[str]
    failed: Counter[str]
    latencies: list[float]


async def _buy(client: httpx.AsyncClient, url: str, body: object, tally: _Tally) -> httpx.Response | None:
    """POST until the server answers for good: the 200 answer, or None (out of stock or failed, counted).

    Only what the server says to retry is retried, after its Retry-After
    (at most 1 s, jittered), MAX_ATTEMPTS times at most.
    """
    for _ in range(MAX_ATTEMPTS):
        began = time.perf_counter()
        try:
            response = await client.post(url, json=body)
        except httpx.HTTPError as exc:
            tally.failed[type(exc).__name__] += 1
            return None
        tally.latencies.append(time.perf_counter() - began)
        kind = problem_type(response)
        if response.status_code == 200:
            return response
        if kind == "out-of-stock":
            tally.out_of_stock += 1
            return None
        if kind not in RETRYABLE:
            tally.failed[f"{response.status_code} {kind}".strip()] += 1
            return None
        tally.retries[kind] += 1
        await asyncio.sleep(retry_after(response) * random.uniform(0.5, 1.0))
    tally.failed["gave up after retries"] += 1
    return None


@dataclass
class SeckillResult:
    buyers: int
    items: int
    sold: int = 0
    out_of_stock: int = 0
    retries: Counter[str] = field(default_factory=Counter)  # retried answers by problem type
    failed: Counter[str] = field(default_factory=Counter)  # anything else, by status or error
    latencies: list[float] = field(default_factory=list)  # seconds per answered request
    remaining: list[int] = field(default_factory=list)  # stock left as each sale saw it
    stock_left: int | None = None

    @property
    def oversold(self) -> int:
        """Sales the stock never recorded (lost updates), plus sales beyond the items."""
        if self.stock_left is None:
            return 0
        return max(0, self.sold - (self.items - self.stock_left)) + max(0, -self.stock_left)


async def seckill(pool: "httpx.AsyncClient | Sequence[httpx.AsyncClient]", urls: list[str], product: str, buyers: int,
                  on_answer: Callable[[], None] = lambda: None, endpoint: str = "deduct") -> SeckillResult:
    """`buyers` concurrent buyers, one item each; retries only what the server says to retry.

    `endpoint` is `deduct` (under the product's lock) or `deduct-atomic` (one Lua script).
    """
    client = _pick(pool, 0)
    stock = (await client.get(f"{urls[0]}/api/stock/{product}")).json()["stock"]
    result = SeckillResult(buyers=buyers, items=stock)
    start = asyncio.Event()

    async def buyer(index: int) -> None:
        url = f"{urls[index % len(urls)]}/api/stock/{product}/{endpoint}"
        mine = _pick(pool, index // len(urls))  # neighbours go to different replicas
        await start.wait()  # everyone fires together
        response = await _buy(mine, url, {"quantity": 1}, result)
        if response is not None:
            result.sold += 1
            result.remaining.append(response.json()["stock"])
        on_answer()

    tasks = [asyncio.create_task(buyer(i)) for i in range(buyers)]
    start.set()
    await asyncio.gather(*tasks)
    result.stock_left = (await client.get(f"{urls[0]}/api/stock/{product}")).json()["stock"]
    return result


@dataclass
class CheckoutResult:
    carts: int
    items: dict[str, int]  # stock of each product before the burst
    bought: int = 0  # carts answered 200
    sold: Counter[str] = field(default_factory=Counter)  # items per product, as the 200 answers say
    out_of_stock: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # anything else (a lock-deadlock among them)
    latencies: list[float] = field(default_factory=list)
    stock_left: dict[str, int] = field(default_factory=dict)

    @property
    def oversold(self) -> int:
        """Per product, sales the stock never recorded (lost updates) plus sales beyond its items."""
        return sum(max(0, self.sold[p] - (self.items[p] - left)) + max(0, -left) for p, left in self.stock_left.items())


def carts(products: Sequence[str], count: int, size: int = 2) -> list[list[str]]:
    """`count` carts of `size` products each, every pair of neighbours named in both orders.

    Cart i takes `size` products starting at product i (round the list), reversed for odd i: carts
    that share products name them in opposite orders, which stacked `lock()` calls would deadlock on.
    """
    made = []
    for index in range(count):
        cart = [products[(index // 2 + k) % len(products)] for k in range(min(size, len(products)))]
        made.append(cart[::-1] if index % 2 else cart)
    return made


async def checkout(pool: "httpx.AsyncClient | Sequence[httpx.AsyncClient]", urls: list[str], products: Sequence[str],
                   count: int, on_answer: Callable[[], None] = lambda: None, size: int = 2) -> CheckoutResult:
    """`count` concurrent checkouts of one item of each of `size` products; retries only what the server says."""
    client = _pick(pool, 0)
    stock = {p: (await client.get(f"{urls[0]}/api/stock/{p}")).json()["stock"] for p in products}
    result = CheckoutResult(carts=count, items=stock)
    start = asyncio.Event()

    async def buyer(index: int, cart: list[str]) -> None:
        url = f"{urls[index % len(urls)]}/api/checkout"
        mine = _pick(pool, index // len(urls))
        body = {"items": [{"sku": sku, "quantity": 1} for sku in cart]}
        await start.wait()
        response = await _buy(mine, url, body, result)
        if response is not None:
            result.bought += 1
            for item in response.json()["items"]:
                result.sold[item["sku"]] += item["quantity"]
        on_answer()

    tasks = [asyncio.create_task(buyer(i, cart)) for i, cart in enumerate(carts(products, count, size))]
    start.set()
    await asyncio.gather(*tasks)
    result.stock_left = {p: (await client.get(f"{urls[0]}/api/stock/{p}")).json()["stock"] for p in products}
    return result


@dataclass
class DoubleSubmitResult:
    requests: int
    created: Counter[int] = field(default_factory=Counter)  # status -> count of first-run answers
    replayed: int = 0
    in_flight: int = 0  # 409 while the first one ran
    other: Counter[str] = field(default_factory=Counter)
    retry_replayed: bool = False
    orders_created: int = 0  # what the handler really did, read back from the shop

    @property
    def duplicates(self) -> int:
        return max(0, self.orders_created - 1)


async def double_submit(pool: "httpx.AsyncClient | Sequence[httpx.AsyncClient]", urls: list[str], product: str, user: str, key: str,
                        requests: int) -> DoubleSubmitResult:
    """`requests` copies of one order (one Idempotency-Key) at once, then one late retry."""
    client = _pick(pool, 0)
    result = DoubleSubmitResult(requests=requests)
    headers = {"Idempotency-Key": f'"{key}"', "X-User-Id": user}
    body = {"product_id": product, "quantity": 1}
    start = asyncio.Event()

    async def submit(index: int) -> None:
        await start.wait()
        try:
            response = await _pick(pool, index // len(urls)).post(
                f"{urls[index % len(urls)]}/api/orders", json=body, headers=headers)
        except httpx.HTTPError as exc:
            result.other[type(exc).__name__] += 1
            return
        if response.headers.get("idempotent-replayed") == "true":
            result.replayed += 1
        elif response.status_code == 201:
            result.created[201] += 1
        elif response.status_code == 409:
            result.in_flight += 1
        else:
            result.other[f"{response.status_code} {problem_type(response)}".strip()] += 1

    tasks = [asyncio.create_task(submit(i)) for i in range(requests)]
    start.set()
    await asyncio.gather(*tasks)
    # The user's retry after everything settled must get the stored answer.
    late = await client.post(f"{urls[-1]}/api/orders", json=body, headers=headers)
    result.retry_replayed = late.headers.get("idempotent-replayed") == "true"
    orders = (await client.get(f"{urls[0]}/api/orders", params={"user": user})).json()["orders"]
    result.orders_created = len(orders)
    return result


@dataclass
class JobResult:
    expected: int  # ticks watched
    runs_per_tick: Counter[int] = field(default_factory=Counter)  # tick -> how many replicas ran it
    by_replica: Counter[str] = field(default_factory=Counter)

    @property
    def doubled(self) -> int:
        """Ticks that ran on more than one replica."""
        return sum(1 for runs in self.runs_per_tick.values() if runs > 1)


async def job_runs(client: httpx.AsyncClient, url: str, first_tick: int, ticks: int, interval: float) -> JobResult:
    """Runs of ticks `first_tick .. first_tick + ticks - 1`, once all were recorded (or a bounded wait ran out)."""
    deadline = time.monotonic() + (ticks + 2) * interval + 5.0
    while True:
        runs = [run for run in (await client.get(f"{url}/api/jobs")).json()["runs"]
                if first_tick <= run["tick"] < first_tick + ticks]
        result = JobResult(ticks, Counter(run["tick"] for run in runs), Counter(run["replica"] for run in runs))
        if len(result.runs_per_tick) >= ticks or time.monotonic() > deadline:
            return result
        await asyncio.sleep(interval)  # the next tick cannot come sooner


def percentiles(values: list[float], qs: Sequence[float] = (0.5, 0.95, 0.99)) -> list[float | None]:
    """Nearest-rank percentiles of client-side samples."""
    if not values:
        return [None for _ in qs]
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))] for q in qs]
