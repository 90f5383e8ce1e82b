"""The demo shop on real replicas: separate uvicorn processes, one real Redis deployment.

Replica sets are started once per module (startup dominates the run time):
three locked replicas with a short job interval, on each deployment the shop
must work on (one Redis, a Sentinel-managed master, a 3-master Redis
Cluster), and two with the locks turned off on one Redis, which must visibly
oversell so we know these tests can fail.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest

from _deployments import KINDS, deployment_url
from otel_lock.cli._redis_server import RedisServer
from otel_lock.cli._demo_load import cache_missing_sniffio, checkout, clients, double_submit, problem_type, seckill
from otel_lock.cli._replicas import Replicas

JOB_INTERVAL = 0.3


@dataclass(frozen=True)
class Deployment:
    kind: str  # single, sentinel or cluster
    url: str


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module", params=KINDS)
def deployment(request, redis):
    """Each deployment the shop must work on (nothing is killed: the failover tests are elsewhere)."""
    if request.param == "single":
        yield Deployment("single", redis.url)  # shared with the unlocked replicas and the port test
        return
    with deployment_url(request.param) as url:
        yield Deployment(request.param, url)


@pytest.fixture(scope="module")
def replicas(deployment):
    with Replicas(deployment.url, count=3, namespace="shop", job_interval=JOB_INTERVAL) as started:
        yield started.urls


@pytest.fixture(scope="module")
def unlocked_replicas(redis):
    # The work delay widens the read-modify-write window, so the race shows on any machine.
    env = {"OTEL_LOCK_DEMO_DISABLE_LOCKS": "1", "OTEL_LOCK_DEMO_WORK_MS": "20"}
    with Replicas(redis.url, count=2, namespace="nolock", env=env, name_prefix="nolock",
                  job_interval=JOB_INTERVAL) as started:
        yield started.urls


@pytest.fixture
async def pool():
    cache_missing_sniffio()
    async with clients(200) as http:
        yield http


@pytest.fixture
def client(pool) -> httpx.AsyncClient:
    return pool[0]


async def put_stock(client, url, product, stock):
    response = await client.put(f"{url}/api/stock/{product}", json={"stock": stock})
    assert response.status_code == 200, response.text


async def test_replicas_share_one_redis_and_namespace(deployment, replicas, client):
    health = [(await client.get(url + "/healthz")).json() for url in replicas]
    assert {(h["namespace"], h["redis"]["run_id"]) for h in health} == {("shop", health[0]["redis"]["run_id"])}
    assert len({h["replica"] for h in health}) == 3
    redis = health[0]["redis"]
    # On a Cluster every primary is named (INFO alone reaches one random node, so replicas would disagree).
    assert (redis["mode"], len(redis["run_ids"])) == {
        "single": ("standalone", 1), "sentinel": ("sentinel", 1), "cluster": ("cluster", 3)}[deployment.kind]
    assert redis["run_id"] == ",".join(redis["run_ids"]) and all(redis["run_ids"])


async def test_seckill_on_two_replicas_sells_exactly_the_stock(replicas, pool, client):
    two = replicas[:2]
    await put_stock(client, two[0], "seckill", 100)
    result = await seckill(pool, two, "seckill", buyers=200)
    assert not result.failed
    assert result.sold == 100 and result.out_of_stock == 100
    assert result.stock_left == 0 and result.oversold == 0
    # Every sale saw a different remainder: 99, 98, ... 0, each exactly once, never below zero.
    assert sorted(result.remaining) == list(range(100))


async def test_atomic_script_seckill_on_two_replicas_sells_exactly_the_stock(replicas, pool, client):
    two = replicas[:2]
    await put_stock(client, two[0], "seckill-atomic", 100)
    result = await seckill(pool, two, "seckill-atomic", buyers=200, endpoint="deduct-atomic")
    assert not result.failed and not result.retries  # no lock: nothing to wait for, nothing to retry
    assert result.sold == 100 and result.out_of_stock == 100 and result.oversold == 0
    assert sorted(result.remaining) == list(range(100))


async def test_without_locks_the_atomic_script_still_sells_exactly_the_stock(unlocked_replicas, pool, client):
    # The same broken shop that oversells below: the script does not depend on the lock.
    await put_stock(client, unlocked_replicas[0], "seckill-atomic", 100)
    result = await seckill(pool, unlocked_replicas, "seckill-atomic", buyers=200, endpoint="deduct-atomic")
    assert result.sold == 100 and result.stock_left == 0 and result.oversold == 0


async def test_without_locks_the_same_seckill_oversells(unlocked_replicas, pool, client):
    await put_stock(client, unlocked_replicas[0], "seckill", 100)
    result = await seckill(pool, unlocked_replicas, "seckill", buyers=200)
    assert result.oversold > 0, "the broken shop did not oversell: this scenario cannot catch a broken lock"
    assert result.sold > 100 - result.stock_left


async def test_checkouts_on_two_replicas_sell_exactly_the_stock_of_every_product(replicas, pool, client):
    """Carts of two of three products, named in both orders, one lock per product (`@locked` with `*`)."""
    two = replicas[:2]
    products = ["cart-a", "cart-b", "cart-c"]
    for product in products:
        await put_stock(client, two[0], product, 40)
    result = await checkout(pool, two, products, 100)
    assert not result.failed, result.failed  # no lock-deadlock, no 5xx, nothing given up
    assert result.bought + result.out_of_stock == 100
    assert result.oversold == 0
    for product in products:  # every sale answered is in the stock, and the stock never went below 0
        assert result.sold[product] == 40 - result.stock_left[product] and result.stock_left[product] >= 0
    assert sum(result.sold.values()) == 2 * result.bought


async def test_without_locks_the_same_checkout_oversells(unlocked_replicas, pool, client):
    products = ["cart-a", "cart-b", "cart-c"]
    for product in products:
        await put_stock(client, unlocked_replicas[0], product, 40)
    result = await checkout(pool, unlocked_replicas, products, 100)
    assert result.oversold > 0, "the broken shop did not oversell: this scenario cannot catch a broken lock"


async def test_one_idempotency_key_on_two_replicas_creates_one_order(replicas, pool, client):
    two = replicas[:2]
    await put_stock(client, two[0], "gift", 50)
    result = await double_submit(pool, two, "gift", user="alice", key="order-1", requests=20)
    assert result.orders_created == 1
    assert result.created[201] + result.replayed + result.in_flight == 20, result.other
    assert result.created[201] <= 1
    assert result.retry_replayed
    first = (await client.get(f"{two[0]}/api/orders", params={"user": "alice"})).json()["orders"][0]

    headers = {"Idempotency-Key": '"order-1"', "X-User-Id": "alice"}
    late = await client.post(f"{two[1]}/api/orders", json={"product_id": "gift", "quantity": 1}, headers=headers)
    assert late.status_code == 201 and late.headers["idempotent-replayed"] == "true"
    assert late.json()["order_id"] == first["order_id"]

    changed = await client.post(f"{two[0]}/api/orders", json={"product_id": "gift", "quantity": 2}, headers=headers)
    assert changed.status_code == 422 and problem_type(changed) == "idempotency-key-mismatch"

    # Same key, another caller: a fresh order of their own, never alice's stored answer.
    bob = await client.post(f"{two[1]}/api/orders", json={"product_id": "gift", "quantity": 1},
                            headers={**headers, "X-User-Id": "bob"})
    assert bob.status_code == 201 and "idempotent-replayed" not in bob.headers
    assert bob.json()["order_id"] != first["order_id"] and bob.json()["user"] == "bob"
    assert (await client.get(f"{two[0]}/api/orders", params={"user": "alice"})).json()["orders"] == [first]
    assert (await client.get(f"{two[0]}/api/stock/gift")).json()["stock"] == 48


async def job_ticks(client, url, count: int) -> tuple[Counter, list[dict]]:
    """Runs per tick for the next `count` ticks, polled until all were recorded (bounded)."""
    # The replicas are up (the fixtures waited for /healthz); count ticks from the next one.
    first_tick = int(time.time() // JOB_INTERVAL) + 1
    wanted = set(range(first_tick, first_tick + count))
    deadline = time.monotonic() + 20
    while True:
        runs = (await client.get(f"{url}/api/jobs")).json()["runs"]
        ticks = Counter(run["tick"] for run in runs if first_tick <= run["tick"] < first_tick + count)
        if wanted <= set(ticks) or time.monotonic() > deadline:
            break
        await asyncio.sleep(JOB_INTERVAL)  # polling for progress, bounded by the deadline
    assert wanted <= set(ticks), f"ticks seen: {sorted(ticks)}"
    return ticks, runs


async def test_job_runs_once_per_tick_on_three_replicas(replicas, client):
    ticks, runs = await job_ticks(client, replicas[2], 6)
    twice = {tick: n for tick, n in ticks.items() if n > 1}
    assert not twice, f"ticks that ran on more than one replica: {twice}"
    assert {run["replica"] for run in runs} <= {"replica-1", "replica-2", "replica-3"}


async def test_without_locks_the_job_runs_on_every_replica(unlocked_replicas, client):
    ticks, _ = await job_ticks(client, unlocked_replicas[0], 3)
    assert set(ticks.values()) == {2}, "the unlocked job did not run twice per tick: the check above could not fail"


def test_replica_whose_port_was_taken_is_respawned_on_another(redis, monkeypatch):
    import socket

    from otel_lock.cli import _replicas

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = iter([taken])
        real = _replicas.free_port
        monkeypatch.setattr(_replicas, "free_port", lambda: next(ports, None) or real())
        with Replicas(redis.url, count=1, namespace="ports") as started:
            assert started.replicas[0].port != taken
            assert httpx.get(started.urls[0] + "/healthz").status_code == 200
