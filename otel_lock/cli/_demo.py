"""`otel-lock demo`: Redis + two replicas + three bursts + the job + a summary, then clean up.

Everything it starts (a redis-server, the replica processes) it stops again
by pid, also on Ctrl-C. The exit status is the verdict: 0 only when nothing
was oversold (by the seckill or a checkout), no order was created twice and no
job tick ran twice.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Sequence, TextIO

from ._redis_server import RedisServer, RedisServerNotFound, redact_url

from ..demo._app import CART_LOCK, STOCK_LOCK
from ._demo_load import (CheckoutResult, DoubleSubmitResult, JobResult, SeckillResult, cache_missing_sniffio, checkout,
                         clients, double_submit, job_runs, percentiles, seckill)
from ._scrape import Histogram, Scrape, scrape
from ._replicas import ReplicaFailed, Replicas

if TYPE_CHECKING:
    import httpx


@dataclass
class DemoOptions:
    redis_url: str | None = None
    replicas: int = 2
    buyers: int = 200
    items: int = 100
    double_submits: int = 20
    namespace: str = "otel-lock-demo"
    job_interval: float = 0.5
    job_ticks: int = 4
    cart_products: int = 3  # products of the checkout burst; each cart takes one item of two of them


class Progress:
    """`label: n/total` on one rewritten line on a terminal, a few lines otherwise."""

    def __init__(self, label: str, total: int, out: TextIO) -> None:
        self.label, self.total, self.out, self.done = label, total, out, 0
        self.tty = out.isatty()
        self._next_mark = 0.25

    def step(self) -> None:
        self.done += 1
        if self.tty:
            self.out.write(f"\r  {self.label}: {self.done}/{self.total} answered")
            if self.done == self.total:
                self.out.write("\n")
            self.out.flush()
        elif self.done >= self._next_mark * self.total:
            self.out.write(f"  {self.label}: {self.done}/{self.total} answered\n")
            self.out.flush()
            while self._next_mark * self.total <= self.done:
                self._next_mark += 0.25


def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> int:
    """Returns the process exit status."""
    redis_url = options.redis_url
    server = None
    replicas = None
    interrupted = _InterruptFlag()
    try:
        if redis_url is None:
            try:
                server = RedisServer().start()
            except RedisServerNotFound as exc:
                print(f"otel-lock demo: {exc}", file=sys.stderr)
                return 1
            redis_url = server.url
            assert server.process is not None  # start() returned: it is running
            name = server.binary.name if server.binary else "redis-server"
            _say(out, f"redis     : started {name} on {redis_url} (pid {server.process.pid})")
        else:
            problem = _unreachable(redis_url)
            if problem:
                print(f"otel-lock demo: cannot reach Redis at {redact_url(redis_url)}: {problem}", file=sys.stderr)
                return 1
            _say(out, f"redis     : using {redact_url(redis_url)}")
        _say(out, f"replicas  : starting {options.replicas} x `otel-lock serve` ...")
        replicas = Replicas(redis_url, count=options.replicas, namespace=options.namespace,
                            job_interval=options.job_interval).start()
        _say(out, "replicas  : " + ", ".join(f"{r.name} {r.url} (pid {r.process.pid})" for r in replicas.replicas))
        # From here asyncio.run's own Ctrl-C handling applies: it cancels the bursts, which close
        # their clients, then raises KeyboardInterrupt (a KeyboardInterrupt raised inside a task
        # would leave tracebacks and never-awaited coroutines behind).
        interrupted.restore()
        return asyncio.run(_bursts(options, replicas.urls, out))
    except ReplicaFailed as exc:
        print(f"otel-lock demo: a replica did not start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\notel-lock demo: interrupted, stopping what it started", file=sys.stderr)
        return 130
    except Exception:
        if not interrupted:
            raise
        # Ctrl-C landed while a client or a task group was unwinding and came
        # out as another exception: it is still an interrupt.
        print("\notel-lock demo: interrupted, stopping what it started", file=sys.stderr)
        return 130
    finally:
        interrupted.restore()
        if replicas is not None:
            replicas.stop()
        if server is not None:
            server.stop()


async def _bursts(options: DemoOptions, urls: list[str], out: TextIO) -> int:
    run = uuid.uuid4().hex[:8]  # a Redis given by the user may hold earlier runs
    first_tick = int(time.time() // options.job_interval) + 1  # every replica is up by then
    cache_missing_sniffio()
    async with clients(max(options.buyers, options.double_submits)) as pool:
        client = pool[0]
        # One product per way: the locked read-modify-write and the script must not share a counter.
        product, atomic_product, order_product = f"seckill-{run}", f"seckill-atomic-{run}", f"gift-{run}"
        cart_products = [f"cart-{n}-{run}" for n in range(1, options.cart_products + 1)]
        for pid, stock in ((product, options.items), (atomic_product, options.items),
                           (order_product, options.double_submits),
                           *((cart_product, options.items) for cart_product in cart_products)):
            (await client.put(f"{urls[0]}/api/stock/{pid}", json={"stock": stock})).raise_for_status()

        _say(out, f"\nseckill   : {options.buyers} concurrent buyers, {options.items} items, "
                  f"round-robin over {len(urls)} replicas, two ways")
        await _warm_up(pool, urls)  # both ways start with open connections
        sales = []
        for endpoint, label in (("deduct", "lock"), ("deduct-atomic", "script")):
            progress = Progress("buyers" if label == "lock" else "buyers (script)", options.buyers, sys.stderr)
            began = time.perf_counter()
            sale = await seckill(pool, urls, atomic_product if label == "script" else product, options.buyers,
                                 progress.step, endpoint=endpoint)
            sales.append(Way(label, endpoint, sale, time.perf_counter() - began))

        _say(out, f"checkout  : {options.buyers} concurrent carts of 2 of {len(cart_products)} products "
                  f"({options.items} items each), the same products named in both orders")
        progress = Progress("carts", options.buyers, sys.stderr)
        began = time.perf_counter()
        carts = await checkout(pool, urls, cart_products, options.buyers, progress.step)
        carts_elapsed = time.perf_counter() - began

        _say(out, f"double    : {options.double_submits} concurrent copies of one order "
                  f"(same Idempotency-Key), then one late retry")
        dup = await double_submit(pool, urls, order_product, f"user-{run}", f"order-{run}",
                                  options.double_submits)
        _say(out, f"job       : every {options.job_interval:g}s on each replica, once per tick if the lock works")
        jobs = await job_runs(client, urls[0], first_tick, options.job_ticks, options.job_interval)
        metrics = await scrape(client, urls)
    _summary(out, sales, carts, carts_elapsed, dup, jobs, metrics)
    return 0 if _passed(sales, carts, dup, jobs) else 1


def _passed(ways: list[Way], carts: CheckoutResult, dup: DoubleSubmitResult, jobs: JobResult) -> bool:
    oversold = sum(way.sale.oversold for way in ways) + carts.oversold
    return oversold == 0 and dup.duplicates == 0 and jobs.doubled == 0


async def _warm_up(pool: list[httpx.AsyncClient], urls: list[str]) -> None:
    for client in pool:
        for url in urls:
            await client.get(f"{url}/healthz")


@dataclass
class Way:
    """One seckill run: `lock` (POST .../deduct) or `script` (POST .../deduct-atomic)."""

    label: str
    endpoint: str
    sale: SeckillResult
    elapsed: float


def seckill_table(ways: list[Way]) -> list[str]:
    """The seckill both ways, side by side: sold, oversell, time, rejections, latency."""
    def row(name: str, cells: list[str]) -> str:
        return f"{name:<14}" + "".join(f"{cell:<34}" for cell in cells).rstrip()

    def problems(sale: SeckillResult) -> str:
        other = sum(sale.failed.values())
        return f"{sale.out_of_stock} x 409 out-of-stock" + (f", {other} other" if other else "")

    return [
        row("seckill", [f"{w.label} (POST .../{w.endpoint})" for w in ways]),
        row("sold", [f"{w.sale.sold} of {w.sale.items} items" for w in ways]),
        row("oversell", [f"{w.sale.oversold}" + ("" if w.sale.oversold == 0 else "  <-- OVERSOLD") for w in ways]),
        row("time", [f"{w.elapsed:.2f}s for {w.sale.buyers} buyers" for w in ways]),
        row("rejected", [problems(w.sale) for w in ways]),
        row("retried", [", ".join(f"{n} x {k}" for k, n in w.sale.retries.items()) or "none" for w in ways]),
        row("stock left", [f"{w.sale.stock_left}" for w in ways]),
        row("request p50", [_ms(percentiles(w.sale.latencies)[0]) for w in ways]),
        row("request p99", [_ms(percentiles(w.sale.latencies)[2]) for w in ways]),
    ]


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


def checkout_lines(carts: CheckoutResult, elapsed: float) -> list[str]:
    """The checkout burst: carts bought, items sold against the stock, oversell, what was retried."""
    items, sold = sum(carts.items.values()), sum(carts.sold.values())
    other = sum(carts.failed.values())
    return [
        f"checkout      {carts.bought} of {carts.carts} carts bought in {elapsed:.2f}s (POST /api/checkout, "
        f"one lock per product), {carts.out_of_stock} x 409 out-of-stock"
        + (f", other: {dict(carts.failed)}" if other else ""),
        f"cart items    {sold} of {items} sold, oversell {carts.oversold}"
        + ("" if carts.oversold == 0 else "  <-- OVERSOLD")
        + ", stock left " + ", ".join(f"{left}" for left in carts.stock_left.values())
        + ", retried " + (", ".join(f"{n} x {k}" for k, n in carts.retries.items()) or "none"),
    ]


def _summary(out: TextIO, ways: list[Way], carts: CheckoutResult, carts_elapsed: float, dup: DoubleSubmitResult,
             jobs: JobResult, metrics: Scrape) -> None:
    passed = _passed(ways, carts, dup, jobs)
    lines = [
        "",
        "== summary ==",
        *seckill_table(ways),
        "              ^ request: deduct round trip, measured client-side",
        *checkout_lines(carts, carts_elapsed),
        f"orders        {dup.orders_created} created for {dup.requests} copies of one order"
        + ("" if dup.duplicates == 0 else f"   <-- {dup.duplicates} DUPLICATE(S)"),
        f"duplicates    {dup.replayed} replayed (Idempotent-Replayed: true), {dup.in_flight} rejected 409 "
        f"while in flight" + (f", other: {dict(dup.other)}" if dup.other else ""),
        f"late retry    {'replayed the stored 201' if dup.retry_replayed else 'NOT replayed'}",
        f"job           {len(jobs.runs_per_tick)} of {jobs.expected} ticks ran, {sum(jobs.runs_per_tick.values())} runs ("
        + ", ".join(f"{name} {n}" for name, n in sorted(jobs.by_replica.items())) + ")"
        + ("" if jobs.doubled == 0 else f"   <-- {jobs.doubled} TICK(S) RAN ON SEVERAL REPLICAS"),
        _quantiles("wait (lock)", metrics.histogram("otel_lock_wait_duration_seconds", STOCK_LOCK)),
        _quantiles("hold (lock)", metrics.histogram("otel_lock_hold_duration_seconds", STOCK_LOCK)),
        "              ^ stock lock, from the replicas' /metrics histograms (histogram_quantile)",
        _quantiles("wait (cart)", metrics.histogram("otel_lock_wait_duration_seconds", CART_LOCK)),
        "              ^ each product's lock of a checkout (the same keys as the stock lock's)",
        f"renewals      ok {metrics.counter('otel_lock_renewals_total', lock_renewal_outcome='ok'):.0f}, "
        f"lost {metrics.counter('otel_lock_renewals_total', lock_renewal_outcome='lost'):.0f}, "
        f"error {metrics.counter('otel_lock_renewals_total', lock_renewal_outcome='error'):.0f}"
        "   (the watchdog renews a lease every lease/3; short holds need none)",
        "",
        "verdict       " + ("OK: no oversell, no duplicate order, one job run per tick"
                            if passed else "FAILED: a lock or the idempotency key did not hold"),
    ]
    _say(out, "\n".join(lines))


def _quantiles(label: str, hist: Histogram) -> str:
    values = [hist.quantile(q) for q in (0.5, 0.95, 0.99)]
    return f"{label:<14}" + _fmt(values) + f"   ({hist.count:.0f} samples)"


def _fmt(values: Sequence[float | None]) -> str:
    return "  ".join(f"p{q} {'n/a' if v is None else f'{v * 1000:.1f} ms'}" for q, v in zip((50, 95, 99), values))


def _unreachable(url: str) -> str | None:
    """Why Redis at `url` does not answer PING ('' when it does): fail in seconds, not at the replicas' timeout.

    Through the core's `from_url`, so a Sentinel service (its master) or a Cluster (a node) is asked the same way.
    """
    from redis.exceptions import RedisClusterException, RedisError

    from ..lock import LockManager

    async def ping() -> None:
        manager = LockManager.from_url(url, socket_timeout=2.0)
        try:
            await manager.redis.ping()
        finally:
            await manager.aclose()

    try:
        asyncio.run(ping())
        return ""
    except (RedisError, RedisClusterException, OSError, ValueError) as exc:
        # redis-py names a missing Sentinel master with its client's repr: keep the sentence only.
        return str(exc).split(" : <", 1)[0] or type(exc).__name__


def _say(out: TextIO, text: str) -> None:
    out.write(text + "\n")
    out.flush()


class _InterruptFlag:
    """Remembers a Ctrl-C (then raises KeyboardInterrupt as usual), so the exit status says 130."""

    def __init__(self) -> None:
        self.seen = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def __bool__(self) -> bool:
        return self.seen

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
