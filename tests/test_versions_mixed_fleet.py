"""The previous release and this one side by side on one Redis (a rolling deploy, a rollback).

The previous release (docs/versioning.md: 0.2.0, by its commit in main's
history) is built into `.venv-0.2.0` by `ensure_previous_release` in
scripts/_bootstrap.sh (scripts/test runs it before the suite). Each replica is
a process of its own release (`tests/_versions_replica.py`); all share one
redis-server. Without that venv the tests fail under CI=true and are
skipped elsewhere, saying how to build it. 0.2.0 writes data model 1 and this
release model 2: their waiters share one queue.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPLICA = Path(__file__).resolve().parent / "_versions_replica.py"
BOOTSTRAP = ROOT / "scripts" / "_bootstrap.sh"
DEADLINE = 20.0   # a bound that turns a hang into a failure, not a timing


def _previous() -> tuple[str, Path]:
    """The previous release's version and its venv's python; skip or fail when it is not built."""
    text = BOOTSTRAP.read_text()
    commit = re.search(r"^PREVIOUS_RELEASE=(\w+)$", text, re.M).group(1)
    version = re.search(r"^PREVIOUS_VERSION=([\w.]+)$", text, re.M).group(1)
    venv = ROOT / f".venv-{version}"
    stamp = venv / ".otel-lock-release"
    if not (venv / "bin" / "python").exists() or not stamp.exists() or stamp.read_text().strip() != commit:
        message = (f"the previous release {version} ({commit[:7]}) is not built in {venv.name}: run "
                   "bash -c 'source scripts/_bootstrap.sh && ensure_previous_release' (scripts/test does)")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return version, venv / "bin" / "python"


NEW = sys.executable


class Replica:
    """A process of one release running `_versions_replica.py`; `ask` sends a command, returns its answer."""

    def __init__(self, release: str, proc: asyncio.subprocess.Process, stderr) -> None:
        self.release, self.proc, self._stderr = release, proc, stderr

    @classmethod
    async def start(cls, release: str, python: str | Path, url: str) -> "Replica":
        stderr = tempfile.TemporaryFile()
        proc = await asyncio.create_subprocess_exec(
            str(python), "-I", str(REPLICA), url, cwd=tempfile.gettempdir(),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr)
        replica = cls(release, proc, stderr)
        try:
            replica.origin = (await replica._read())["ready"]
        except BaseException:
            proc.kill()
            await proc.wait()
            stderr.close()
            raise
        return replica

    async def _read(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), DEADLINE)
        if not line:
            self._stderr.seek(0)
            raise AssertionError(f"{self.release} replica ended: {self._stderr.read().decode()[-3000:]}")
        return json.loads(line)

    async def send(self, **cmd) -> None:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()

    async def ask(self, **cmd) -> dict:
        await self.send(**cmd)
        return await self._read()

    async def post(self, key: str, body: str = '{"amount": 5}', path: str = "/charge",
                   content_type: str = "application/json", **headers: str) -> dict:
        return await self.ask(op="post", path=path, body=body,
                              headers={"idempotency-key": key, "content-type": content_type, **headers})

    async def stop(self) -> None:
        if self.proc.returncode is None:
            await self.send(op="exit")
            try:
                await asyncio.wait_for(self.proc.wait(), DEADLINE)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._stderr.close()


@pytest.fixture
async def fleet(redis_url):
    """start(release) -> a Replica of "old" (the previous release) or "new" (this tree); all stopped after."""
    _, old_python = _previous()
    started: list[Replica] = []

    async def start(release: str) -> Replica:
        replica = await Replica.start(release, old_python if release == "old" else NEW, redis_url)
        started.append(replica)
        return replica

    yield start
    for replica in started:
        await replica.stop()


async def _runs(redis_url: str, key: str) -> int:
    import redis.asyncio as aioredis
    client = aioredis.Redis.from_url(redis_url)
    try:
        return int(await client.get(f"runs:{key}") or 0)
    finally:
        await client.aclose()


def _replayed(first: dict, retry: dict) -> bool:
    return (retry["status"] == first["status"] and retry["body"] == first["body"]
            and retry["headers"].get("idempotent-replayed") == "true")


async def test_each_replica_runs_its_own_release(fleet):
    version, _ = _previous()
    old, new = await fleet("old"), await fleet("new")
    assert f".venv-{version}" in old.origin and str(ROOT / "otel_lock") in new.origin
    assert f".venv-{version}" not in new.origin


async def test_locks_exclude_each_other_across_releases(fleet, redis_url):
    import redis.asyncio as aioredis
    replicas = [await fleet(release) for release in ("old", "new", "old", "new")]
    n = 40
    for replica in replicas:
        await replica.send(op="count", n=n)
    answers = [await replica._read() for replica in replicas]
    client = aioredis.Redis.from_url(redis_url)
    try:
        counter = int(await client.get("counter"))
    finally:
        await client.aclose()
    assert counter == n * len(replicas)                            # no update lost
    assert [a["max_inside"] for a in answers] == [1] * len(replicas)  # never two holders
    tokens = [token for _, token in sorted(hold for a in answers for hold in a["holds"])]
    assert tokens == sorted(set(tokens))  # in the order of the holds, strictly growing across both releases


MULTIPART = ('--xyz\r\nContent-Disposition: form-data; name="f"; filename="a.txt"\r\n'
             'Content-Type: text/plain\r\n\r\nhello\r\n--xyz--\r\n')
REQUESTS = [   # (path, body, content type, headers): what 0.1.0 and later releases fingerprint differently
    ("/charge", '{"amount": 5}', "application/json", {}),
    ("/charge?sku=a&qty=2", '{"b": 1, "a": [1, 2]}', "application/json", {}),
    ("/charge", MULTIPART, "multipart/form-data; boundary=xyz", {}),
    ("/pay", '{"amount": 7}', "application/json", {"x-user": "alice"}),
]


@pytest.mark.parametrize("first_on, retry_on", [("new", "old"), ("old", "new")])
async def test_an_answer_of_either_release_is_replayed_by_the_other(fleet, redis_url, first_on, retry_on):
    replicas = {"old": await fleet("old"), "new": await fleet("new")}
    for i, (path, body, content_type, headers) in enumerate(REQUESTS):
        key = f"{first_on}-{i}"
        first = await replicas[first_on].post(key, body, path, content_type, **headers)
        retry = await replicas[retry_on].post(key, body, path, content_type, **headers)
        again = await replicas[first_on].post(key, body, path, content_type, **headers)
        assert first["status"] == 201, first
        assert _replayed(first, retry), (path, content_type, retry)   # never run twice, never 422
        assert _replayed(first, again), again
        assert await _runs(redis_url, key) == 1


async def test_a_rollback_after_writes_loses_no_record(fleet, redis_url):
    new = [await fleet("new"), await fleet("new")]
    firsts = {}
    for i, (path, body, content_type, headers) in enumerate(REQUESTS):
        firsts[i] = await new[i % 2].post(f"r-{i}", body, path, content_type, **headers)
    for replica in new:          # the rollback: only the previous release serves from here on
        await replica.stop()
    old = await fleet("old")
    for i, (path, body, content_type, headers) in enumerate(REQUESTS):
        retry = await old.post(f"r-{i}", body, path, content_type, **headers)
        assert firsts[i]["status"] == 201 and _replayed(firsts[i], retry), retry
        assert await _runs(redis_url, f"r-{i}") == 1


@pytest.mark.parametrize("holder, other", [("new", "old"), ("old", "new")])
async def test_a_request_in_flight_on_one_release_is_409_on_the_other(fleet, redis_url, holder, other):
    replicas = {"old": await fleet("old"), "new": await fleet("new")}
    request = {"op": "hold", "path": "/charge?hold=1", "body": '{"amount": 9}',
               "headers": {"idempotency-key": "slow", "content-type": "application/json"}}
    assert await replicas[holder].ask(**request) == {"entered": True}
    busy = await replicas[other].ask(**{**request, "op": "post"})
    first = await replicas[holder].ask(op="release")
    retry = await replicas[other].ask(**{**request, "op": "post"})
    assert busy["status"] == 409 and json.loads(busy["body"])["type"].endswith("idempotency-request-in-flight")
    assert first["status"] == 201 and _replayed(first, retry), retry
    assert await _runs(redis_url, "slow") == 1


# The hex 0.1.0 itself gave for these requests: this test's earlier form ran them through 0.1.0's own
# `fingerprint` in its venv (while 0.1.0 was the previous release) and compared; the digests are kept.
V1_SCOPES = [
    ({"method": "POST", "path": "/a/b", "query_string": b"x=1&y=%20z&x=0",
      "headers": [(b"content-type", b"application/json")]}, "/a/{id}", '{"b": 1, "a": "\\u00e9"}',
     "22fa0d6b4dd335fd5b42c9107d3c47c72d6fcc6da06bc4998dee5eca63365bae"),
    ({"method": "PUT", "path": "/c", "query_string": b"", "headers": [(b"Content-Type", b"Multipart/Form-Data; boundary=q")]},
     "/c", "--q\r\n\r\nx\r\n--q--", "f5c7539d8ebf2f37bec07a15916cb0a3031664c83a4e9901ea40d59c7f25afcf"),
    ({"method": "POST", "path": "/d", "query_string": b"", "headers": []}, "/d", "not json",
     "062bb619df96600952310933222fbaacb90c14469c1b34b3f273739da8cb40b6"),
    ({"method": "DELETE", "path": "/e", "query_string": b"", "headers": [(b"host", b"a.example")]}, "/e", "",
     "c3016ada2ed7928b516a203f401145dc43e9b8e5b491e8350a1266be87aa47c1"),
    ({"method": "POST", "path": "/f", "query_string": b"", "headers": [(b"content-type", b"text/plain")]}, "/f",
     '{"json": "but text"}', "3da3e91b925bbfcc51fac58c257fa90824fbf6a5dec89b3f46554beca14c132e"),
]


@pytest.mark.parametrize("scope, route, body, recorded", V1_SCOPES)
def test_the_0_1_0_fingerprint_is_recomputed_exactly(scope, route, body, recorded):
    """fingerprint_v1 is 0.1.0's own algorithm: the hex 0.1.0 gave for the same request."""
    from otel_lock.asgi.idempotency._fingerprint_v1 import fingerprint_v1
    assert fingerprint_v1(b"k", scope, route, body.encode("latin-1")) == recorded


def test_the_previous_release_is_named_by_one_commit_everywhere():
    """The bootstrap builds, docs/versioning.md names, and the commit itself says, the same release."""
    text = BOOTSTRAP.read_text()
    commit = re.search(r"^PREVIOUS_RELEASE=(\w+)$", text, re.M).group(1)
    version = re.search(r"^PREVIOUS_VERSION=([\w.]+)$", text, re.M).group(1)
    assert re.search(rf"\| {re.escape(version)} \| `{commit}` \|", (ROOT / "docs" / "versioning.md").read_text())
    script = (ROOT / "scripts" / "test").read_text()
    assert script.index("ensure_previous_release") < script.index("\nrun_job behaviour")
    shown = subprocess.run(["git", "show", f"{commit}:otel_lock/__init__.py"], cwd=ROOT, capture_output=True,
                           text=True)
    if shown.returncode != 0:
        pytest.skip(f"commit {commit[:7]} is not in this clone: {shown.stderr.strip()}")
    assert f'__version__ = "{version}"' in shown.stdout
