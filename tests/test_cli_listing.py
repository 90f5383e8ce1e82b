"""`otel-lock locks` and `held_locks()` on what an operator finds in a namespace: hand-written hashes, keys
without expiry, a user who may not read the keys, a huge hash."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import redis

from otel_lock import LockManager, RedisMisconfigured
from otel_lock.cli import main


def _admin(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


async def test_hand_written_hashes_are_listed_readably_not_as_a_traceback(redis_url, capsys):
    """A strict decode and bare int() made a non-UTF-8 owner or key, or depth 'abc', a traceback."""
    admin = _admin(redis_url)
    admin.hset("hw:{a}", mapping={"owner": b"\xff\xfe", "depth": "abc", "token": "1.5"})
    admin.hset(b"hw:{\xff}", mapping={"owner": "pod-b", "depth": 2, "token": 9})
    admin.pexpire(b"hw:{\xff}", 60_000)
    assert await asyncio.to_thread(main, ["locks", "--redis-url", redis_url, "--namespace", "hw"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows[0] == ["hw:{\\xff}", "pod-b", "2", rows[0][3], "9"]
    assert rows[1] == ["hw:{a}", "\\xff\\xfe", "?", "none", "?"]
    assert await asyncio.to_thread(main, ["locks", "--json", "--redis-url", redis_url, "--namespace", "hw"]) == 0
    odd = json.loads(capsys.readouterr().out)[1]
    assert odd == {"key": "hw:{a}", "name": "a", "owner": "\\xff\\xfe", "depth": None, "ttl": None, "token": None}
    async with LockManager.from_url(redis_url, namespace="hw") as locks:
        infos = await locks.held_locks()
    assert [(i.key, i.owner, i.depth, i.token) for i in infos] == [("hw:{\\xff}", "pod-b", 2, 9),
                                                                   ("hw:{a}", "\\xff\\xfe", -1, -1)]


async def test_a_lock_without_expiry_is_listed_as_never_expiring(redis_url, capsys):
    """PTTL -1 was listed as TTL 0.0s (expiring now) when it is the stuck lock that never expires."""
    async with LockManager.from_url(redis_url, namespace="ttl") as locks:
        held = await locks.acquire("stock:1", lease=60, wait=0)
        _admin(redis_url).persist("ttl:{stock:1}")
        [info] = await locks.held_locks()
        assert info.ttl == math.inf
        assert await asyncio.to_thread(main, ["locks", "--redis-url", redis_url, "--namespace", "ttl"]) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[3] == "none"
        assert await asyncio.to_thread(main, ["locks", "--json", "--redis-url", redis_url, "--namespace", "ttl"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["ttl"] is None
        await held.release()


@pytest.fixture
def reader_of_shop(redis_url):
    """The docs' minimal ACL user for namespace `shop`, which may SCAN but not read `otel-lock:*`."""
    admin = _admin(redis_url)
    admin.execute_command("ACL", "SETUSER", "shopapp", "reset", "on", ">pw", "~shop:*", "&shop:wake:*", "+@read",
                          "+@write", "+time", "+evalsha", "+script|load", "+publish", "+subscribe", "+ping")
    yield redis_url.replace("redis://", "redis://shopapp:pw@", 1)
    admin.execute_command("ACL", "DELUSER", "shopapp")


@pytest.mark.parametrize("form", [[], ["--json"]], ids=["text", "json"])
async def test_keys_the_user_may_not_read_are_an_error_not_an_empty_list(redis_url, reader_of_shop, form, capsys):
    """Every per-key error was 'not a lock': a NOPERM listing said 'no locks held', exit 0."""
    async with LockManager.from_url(redis_url) as locks:
        held = await locks.acquire("stock:1001", lease=60, wait=0)
        code = await asyncio.to_thread(main, ["locks", *form, "--redis-url", reader_of_shop])
        async with LockManager.from_url(reader_of_shop) as theirs:
            with pytest.raises(RedisMisconfigured, match="ACL SETUSER shopapp"):
                await theirs.held_locks()
        await held.release()
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "refused the user" in err and "ACL SETUSER shopapp ~otel-lock:*" in err


async def test_a_listing_reads_only_the_fields_it_shows(redis_url, capsys):
    """HGETALL read a whole hash: one of 3M fields outlasted the socket timeout ("Redis unreachable").

    A user who may not run HGETALL lists the locks: HMGET of the three fields, never the whole hash.
    """
    admin = _admin(redis_url)
    admin.execute_command("ACL", "SETUSER", "nohgetall", "reset", "on", ">pw", "~*", "&*", "+@all", "-hgetall")
    admin.eval("for i = 1, 50000 do redis.call('HSET', KEYS[1], 'f' .. i, 'v') end "
               "redis.call('HSET', KEYS[1], 'owner', 'someone', 'depth', 1, 'token', 3)", 1, "big:{huge}")
    try:
        url = redis_url.replace("redis://", "redis://nohgetall:pw@", 1)
        code = await asyncio.to_thread(main, ["locks", "--json", "--redis-url", url, "--namespace", "big"])
    finally:
        admin.execute_command("ACL", "DELUSER", "nohgetall")
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert [(row["owner"], row["depth"], row["token"]) for row in json.loads(out)] == [("someone", 1, 3)]
