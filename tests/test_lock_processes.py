"""The lock across OS processes: exclusion, fairness, SIGSTOP/SIGKILL, FIFO wake-up.

Each child process (`_proc_helpers.Agent`) has its own event loop and its own
LockManager.from_url(url); the test talks to it over pipes and synchronises on
what it reports or on the lock's state in Redis, never on sleeps.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from _proc_helpers import DEADLINE, Agents, TcpProxy, entered_instead_of_queueing, keys, queued, until
from otel_lock import LockManager

pytestmark = pytest.mark.timeout(90)

@pytest.fixture
async def locks(redis_url):
    manager = LockManager.from_url(redis_url)
    yield manager
    await manager.aclose()


async def run_rmw(agents: Agents, redis, *, use_lock: bool, procs=4, tasks=2, iterations=25):
    workers = await agents.start_many([f"p{i}" for i in range(procs)])
    # Every child is up before any starts, so the workloads overlap.
    for agent in workers:
        await agent.send("rmw", id="rmw", key="counter", counter="count", use_lock=use_lock,
                         tasks=tasks, iterations=iterations)
    results = [await agent.expect("rmw_done", "rmw", timeout=60) for agent in workers]
    return int(await redis.get("count")), results, procs * tasks * iterations


async def test_mutual_exclusion_across_processes_keeps_the_count_exact(agents, redis_client):
    count, results, expected = await run_rmw(agents, redis_client, use_lock=True)
    assert count == expected

    # time.monotonic is one clock for the whole machine (CLOCK_MONOTONIC on Linux).
    intervals = sorted(tuple(i) for r in results for i in r["intervals"])
    assert len(intervals) == expected
    overlaps = [(a, b) for a, b in zip(intervals, intervals[1:]) if b[0] < a[1]]
    assert overlaps == []


async def test_without_the_lock_the_same_workload_loses_updates(agents, redis_client):
    # The control: proves the workload races, so the exact count above means something.
    count, _, expected = await run_rmw(agents, redis_client, use_lock=False)
    assert count < expected


async def test_busy_lock_changes_hands_and_no_worker_starves(agents, redis_client, record_property):
    total = 400
    workers = await agents.start_many([f"p{i}" for i in range(4)])
    for agent in workers:
        await agent.send("fair", id="fair", key="fair", log="log", total=total, tasks=2)
    for agent in workers:
        await agent.expect("fair_done", "fair", timeout=60)

    log = [entry.decode().split() for entry in await redis_client.lrange("log", 0, -1)]
    order, tokens = [w for w, _ in log], [int(t) for _, t in log]
    assert len(order) == total
    assert all(a < b for a, b in zip(tokens, tokens[1:]))  # fencing: strictly increasing, across processes
    handoffs = sum(a != b for a, b in zip(order, order[1:]))
    busiest = max(order.count(w) for w in set(order)) / total
    record_property("handoff_ratio", round(handoffs / (total - 1), 3))
    record_property("busiest_share", round(busiest, 3))
    print(f"handoffs {handoffs}/{total - 1}, busiest worker {busiest:.1%}, workers {len(set(order))}")
    assert len(set(order)) == 8
    assert handoffs >= (total - 1) // 2
    assert busiest <= 0.40


@pytest.mark.parametrize("cancel_on_lost", [False, True], ids=["lost-event", "LockLost"])
async def test_holder_stopped_past_its_lease_loses_it_to_a_larger_token(agents, locks, redis_client, cancel_on_lost):
    holder = await agents.start("holder", lease=1.0)
    await holder.send("hold", id="h", key="stopped", cancel_on_lost=cancel_on_lost)
    first = await holder.expect("acquired", "h")

    holder.signal(signal.SIGSTOP)
    try:
        # Its watchdog cannot renew: the lease runs out and we get the lock.
        async with locks.lock("stopped", wait=DEADLINE, lease=30.0) as held:
            assert held.token > first["token"]
            holder.signal(signal.SIGCONT)
            if cancel_on_lost:
                await holder.expect("locklost", "h")
            else:
                await holder.expect("lost", "h")
                await holder.send("release", id="h")
                await holder.expect("exited", "h")
            # The late holder's release is owner-checked: our lock survives it.
            assert (await redis_client.hget(held.key, "owner")).decode() == held.owner
    finally:
        holder.signal(signal.SIGCONT)


async def test_killed_queued_waiter_does_not_strand_the_lock(agents, redis_client, record_property):
    holder, doomed, patient = await agents.start_many(["holder", "doomed", "patient"], lease=30.0)
    await holder.send("hold", id="h", key="k")
    h = await holder.expect("acquired", "h")
    await doomed.send("hold", id="w", key="k", wait=30.0)
    await queued(redis_client, "k", 1)
    await patient.send("hold", id="x", key="k", wait=30.0)
    await queued(redis_client, "k", 2)

    doomed.signal(signal.SIGKILL)
    await doomed.proc.wait()
    await holder.send("release", id="h")
    released = await holder.expect("releasing", "h")
    # A liveness bound far below the 30 s lease the dead waiter asked for.
    x = await patient.expect("acquired", "x", timeout=10.0)

    delay = x["t"] - released["t"]
    record_property("dead_waiter_delay_s", round(delay, 3))
    print(f"lock reached the next live waiter {delay * 1000:.0f} ms after the release")
    assert x["token"] > h["token"]
    assert await redis_client.zcard(keys("k")[1]) == 0


async def test_release_wakes_exactly_the_next_waiter_in_queue_order(agents, redis_client):
    # poll_cap beyond the test's duration: any Redis call a waiter
    # makes after queueing is a wake-up, not a fallback poll or a lease top-up.
    quiet = dict(lease=30.0, poll_cap=60.0)
    holder, *hosts = await agents.start_many(["holder", "p1", "p2", "p3"], **quiet)
    await holder.send("hold", id="h", key="fifo", lease=30.0)
    await holder.expect("acquired", "h")
    waiters = []
    for i in range(6):
        host = hosts[i % len(hosts)]
        await host.send("hold", id=f"w{i}", key="fifo", wait=DEADLINE, lease=30.0)
        await queued(redis_client, "fifo", i + 1)
        waiters.append((host, f"w{i}"))

    current = (holder, "h")
    for host, ident in waiters:
        before = await _script_calls(redis_client)
        await current[0].send("release", id=current[1])
        event = await host.expect("acquired", ident)
        after = await _script_calls(redis_client)
        # One release script and one message; the woken waiter needed no round trip.
        assert (after["evalsha"] - before["evalsha"], after["publish"] - before["publish"]) == (1, 1), ident
        others = [e for a in [holder, *hosts] for e in a.pending_events() if e["ev"] == "acquired"]
        assert others == [], f"{ident} was handed the lock but others also woke: {others}"
        assert event["attempts"] in (1, 2)  # queued on its first or second call, never polled
        current = (host, ident)
    await current[0].send("release", id=current[1])
    await current[0].expect("exited", current[1])
    lock, queue, waiting = keys("fifo")
    assert await redis_client.exists(lock, queue, waiting) == 0


async def _script_calls(redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    def ok(name):  # a NOSCRIPT refusal (first use of a script on this server) is not a call
        stat = stats.get(f"cmdstat_{name}", {})
        return stat.get("calls", 0) - stat.get("failed_calls", 0)
    return {name: ok(name) for name in ("evalsha", "publish")}


@pytest.mark.parametrize("pause", ["SIGSTOP", "blocked-loop"])
async def test_waiter_paused_past_its_hand_over_grace_does_not_use_the_stale_grant(agents, locks, redis_client, pause):
    holder, sleeper = await agents.start_many(["holder", "sleeper"], lease=30.0)
    await holder.send("hold", id="h", key="grant")
    await holder.expect("acquired", "h")
    # A short fixed lease, so the lease it is handed runs out while it is paused.
    await sleeper.send("hold", id="s", key="grant", wait=DEADLINE, lease=1.0)
    await queued(redis_client, "grant", 1)
    if pause == "SIGSTOP":
        sleeper.signal(signal.SIGSTOP)
    else:  # sync code in an async app: the waiter's loop runs nothing meanwhile
        await sleeper.send("block", id="b", key="unblock")
        await sleeper.expect("blocking", "b")
    try:
        async with asyncio.TaskGroup() as group:
            mine = group.create_task(locks.acquire("grant", wait=DEADLINE))
            await queued(redis_client, "grant", 2)
            await holder.send("release", id="h")  # handed to the stopped sleeper first
        held = mine.result()  # ...whose lease ran out while it was paused, so it passed to us
        sleeper.signal(signal.SIGCONT)
        await redis_client.lpush("unblock", "go")
        # While we hold the lock, the resumed sleeper must not believe it holds it too.
        early = await entered_instead_of_queueing(sleeper, redis_client, "grant", "s")
        if early is not None:
            lost = await sleeper.expect("lost", "s")
            print(f"the resumed sleeper ran {(lost['t'] - early['t']) * 1000:.0f} ms on a stale grant "
                  f"(token {early['token']} < {held.token})")
        assert early is None, "mutual exclusion broken: the sleeper entered while we held the lock"
        assert await held.release()
        legit = await sleeper.expect("acquired", "s")
        assert legit["token"] > held.token
    finally:
        sleeper.signal(signal.SIGCONT)


async def test_explicit_owner_is_shared_across_processes_and_excludes_everyone_else(agents, redis_client):
    first, second, outsider = await agents.start_many(["first", "second", "outsider"], lease=30.0)
    await first.send("hold", id="a", key="shared", owner="job-42")
    a = await first.expect("acquired", "a")
    await second.send("hold", id="b", key="shared", owner="job-42", wait=1.0)
    b = await second.expect("acquired", "b")  # the same owner joins at once
    assert (a["owner"], b["owner"], b["token"]) == ("job-42", "job-42", a["token"])
    assert int(await redis_client.hget(keys("shared")[0], "depth")) == 2

    await outsider.send("hold", id="x", key="shared", wait=DEADLINE)
    await queued(redis_client, "shared", 1)
    await first.send("release", id="a")
    await first.expect("exited", "a")
    # One sharer left: still held, the outsider still waits.
    assert int(await redis_client.hget(keys("shared")[0], "depth")) == 1
    assert await redis_client.zcard(keys("shared")[1]) == 1
    await second.send("release", id="b")
    x = await outsider.expect("acquired", "x")
    assert x["token"] > a["token"]


async def test_exclusion_holds_while_a_contending_process_is_killed_mid_run(agents, redis_client):
    # Short leases, so the victim's lock (if it held one when it died) frees quickly.
    victim, *survivors = await agents.start_many([f"p{i}" for i in range(4)], lease=1.0)
    for agent in [victim, *survivors]:
        await agent.send("rmw", id="rmw", key="chaos", counter="count", use_lock=True, tasks=2, iterations=40)

    async def under_way():
        return int(await redis_client.get("count") or 0) >= 40
    await until(under_way, "the workload to be under way")
    victim.signal(signal.SIGKILL)  # holding, queued or in between: whatever it was doing
    results = [await agent.expect("rmw_done", "rmw", timeout=60) for agent in survivors]

    intervals = sorted(tuple(i) for r in results for i in r["intervals"])
    assert len(intervals) == len(survivors) * 2 * 40
    assert [(a, b) for a, b in zip(intervals, intervals[1:]) if b[0] < a[1]] == []
    # Every survivor's increment counted; the victim's are some number up to its share.
    assert len(intervals) <= int(await redis_client.get("count")) <= len(intervals) + 2 * 40


async def test_waiter_whose_poll_reply_was_read_late_does_not_use_a_stale_grant(agents, locks, redis_client, redis_server):
    # The waiter dates grants by Redis' clock offset, measured from its last queue
    # reply. Here that reply is read late (its loop was blocked), together with
    # a grant that expired meanwhile: the offset must not make the grant look fresh.
    proxy = await TcpProxy("127.0.0.1", redis_server.port).start()
    try:
        held = await locks.acquire("late")
        sleeper = await agents.start("sleeper", proxy.url, lease=30.0, socket_timeout=10.0)
        await sleeper.send("hold", id="s", key="late", wait=DEADLINE, lease=1.0)
        await queued(redis_client, "late", 1)

        proxy.stall_commands()  # the sleeper's next fallback poll runs, its reply waits
        before = await _script_calls(redis_client)

        async def polled():
            return (await _script_calls(redis_client))["evalsha"] > before["evalsha"]
        await until(polled, "the sleeper's fallback poll")
        await sleeper.send("block", id="b", key="unblock")  # ...and its loop is blocked
        await sleeper.expect("blocking", "b")

        assert await held.release()  # handed to the blocked sleeper, with its 1 s lease

        async def expired():
            return not await redis_client.exists(keys("late")[0])
        await until(expired, "the unread grant to expire")
        mine = await locks.try_lock("late")
        assert mine is not None
        proxy.forward()
        await redis_client.lpush("unblock", "go")  # the poll reply and the grant are read together
        early = await entered_instead_of_queueing(sleeper, redis_client, "late", "s")
        assert early is None, (f"mutual exclusion broken: the sleeper entered with token {early['token']} "
                               f"while we held the lock with {mine.token}")
        assert await mine.release()
        assert (await sleeper.expect("acquired", "s"))["token"] > mine.token
    finally:
        await proxy.aclose()
