"""`otel-lock unlock` when the audit record cannot be written: checked before the release where it can be,
said plainly after it where it cannot."""

from __future__ import annotations

import asyncio

import pytest
import redis

from otel_lock.cli import main


def _hold(url: str, name: str) -> redis.Redis:
    admin = redis.Redis.from_url(url)
    admin.hset(f"otel-lock:{{{name}}}", mapping={"owner": "dead-pod:1", "depth": 1, "token": 5})
    admin.pexpire(f"otel-lock:{{{name}}}", 60_000)
    return admin


def test_a_reason_redis_cannot_be_sent_is_refused_before_the_release(redis_url, capsys):
    """A lone surrogate (a non-UTF-8 terminal) released the lock, then failed the audit with exit 2."""
    admin = _hold(redis_url, "a")
    with pytest.raises(SystemExit) as exc:
        main(["unlock", "a", "--reason", "caf\udce9", "--redis-url", redis_url])
    assert exc.value.code == 2
    assert "the reason 'caf\\xe9' is not UTF-8 text" in capsys.readouterr().err
    assert admin.exists("otel-lock:{a}") and not admin.exists("otel-lock:audit")


async def test_a_release_whose_audit_record_fails_says_it_was_released(redis_url, capsys):
    """A user without XADD: the lock was released, yet unlock said only that it failed (exit 1)."""
    admin = _hold(redis_url, "b")
    admin.execute_command("ACL", "SETUSER", "op", "reset", "on", ">pw", "~*", "&*", "+@all", "-xadd")
    url = redis_url.replace("redis://", "redis://op:pw@", 1)
    try:
        code = await asyncio.to_thread(main, ["unlock", "b", "--reason", "pod gone", "--redis-url", url])
    finally:
        admin.execute_command("ACL", "DELUSER", "op")
    out, err = capsys.readouterr()
    assert code == 3
    assert not admin.exists("otel-lock:{b}")
    assert out.startswith("released lock 'b' in namespace 'otel-lock'") and "NOT audited" in out
    assert err.count("\n") == 1 and "lock 'b' in namespace 'otel-lock' WAS released, but its audit record " \
        "could not be written to otel-lock:audit" in err and "xadd" in err.lower()
