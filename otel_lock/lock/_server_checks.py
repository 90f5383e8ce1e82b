"""What a Redis server offers the lock manager, checked once: the facts, and what follows from them.

`check_server(run, namespace=...)` asks one server (one Cluster master) through
`run(*args)`, any async callable that sends a command and returns its reply
(redis-py's `execute_command`, or the core's lean `Connection.execute`), and
returns a frozen `ServerReport`: server and version, memory limit and
eviction policy, persistence, replication role, the ACL rights the manager
needs, and a round trip. It reads what `INFO` publishes and falls back to
`CONFIG GET`; managed services often refuse `CONFIG` and some publish no
policy at all, so every value may be unknown, and an unknown value is
reported as such, never raised.

Rights are probed without side effects anyone could see: `ACL DRYRUN` when
the user may run it, else the commands themselves, on throw-away keys and a
channel of the namespace that no lock ever uses (`<ns>:{otel-lock-check}:*`,
`<ns>:wake:otel-lock-check`), inside one script that deletes what it wrote.

The decisions (docs/lock.md, "Server checks"):

    refusal  a server below Redis 7.0 / Valkey 8; no right to run or load the
             scripts; no right to the namespace's keys; an evicting (or
             unknown) policy when require_noeviction=True
    warning  an evicting maxmemory-policy; no right to the wake channels (the
             manager then polls); memory near maxmemory; a replica; an
             untested server
    note     what an operator should know but need not act on (persistence,
             an unknown value, a round trip)
"""

from __future__ import annotations

import hashlib
import logging
import re
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Literal

from redis.exceptions import NoScriptError

from ._errors import RedisMisconfigured
from ._scripts import SCRIPT_COMMANDS, script_refused

__all__ = ["MIN_REDIS", "MIN_VALKEY", "SCRIPT_COMMANDS", "Check", "ServerHealth", "ServerReport", "check_server",
           "server_identity"]

MIN_REDIS = (7, 0)
MIN_VALKEY = (8, 0)


Run = Callable[..., Awaitable[Any]]
Verdict = Literal["ok", "note", "warning", "refusal"]
log = logging.getLogger("otel_lock")

# Throw-away names: a lock's keys are `<ns>:{name}` plus :fence, :q, :w, never these suffixes.
_PROBE_TAG = "{otel-lock-check}"
_PROBE_CHANNEL = "wake:otel-lock-check"
_PROBE = r"""
-- KEYS: a hash, a string and a zset of the namespace that no lock uses
-- ARGV: a wake channel of the namespace, 'PUBLISH' or 'SPUBLISH'
-- Runs every command the lock's scripts run and returns {command, error, ...} for each refused one.
-- Each key it creates expires in 1 s and is deleted before it returns, so nothing is left.
local denied = {}
local function try(command, ...)
  local reply = redis.pcall(command, ...)
  if type(reply) == 'table' and reply.err and not string.find(reply.err, 'WRONGTYPE', 1, true) then
    denied[#denied + 1] = command
    denied[#denied + 1] = reply.err
  end
end
local h, s, z = KEYS[1], KEYS[2], KEYS[3]
try('TIME')
try('EXISTS', h)
try('HGET', h, 'owner')
try('HMGET', h, 'owner', 'token')
try('GET', s)
try('PTTL', h)
try('ZPOPMIN', z)
try('ZREM', z, 'otel-lock-check')
try('ZSCORE', z, 'otel-lock-check')
try('HDEL', h, 'otel-lock-check')
try('PEXPIRE', h, 1000)
try('PEXPIREAT', h, 1)
try('PEXPIRETIME', h)
try('ZCARD', z)
try('ZRANGE', z, 0, 0)
try('ZRANGEBYSCORE', z, 0, 1)
try('ZREMRANGEBYSCORE', z, 0, 1)
try('DEL', h, s, z)
try('HSET', h, 'owner', 'otel-lock-check')
redis.pcall('PEXPIRE', h, 1000)
try('HINCRBY', h, 'depth', 1)
try('SET', s, '1', 'PX', 1000)
try('ZADD', z, 1, 'otel-lock-check')
redis.pcall('PEXPIRE', z, 1000)
redis.pcall('DEL', h, s, z)
try(ARGV[2], ARGV[1], 'otel-lock check')
return denied
"""
_PROBE_SHA = hashlib.sha1(_PROBE.encode()).hexdigest()
# What ACL DRYRUN is asked for each command the scripts run (keys as the probe's).
_DRYRUN_ARGS: dict[str, tuple[str, ...]] = {
    "DEL": ("h",), "EXISTS": ("h",), "GET": ("s",), "HDEL": ("h", "f"), "HGET": ("h", "f"), "HMGET": ("h", "f", "g"),
    "HINCRBY": ("h", "f", "1"), "HSET": ("h", "f", "v"), "PEXPIRE": ("h", "1000"), "PTTL": ("h",),
    "SET": ("s", "1", "PX", "1000"), "TIME": (), "ZADD": ("z", "1", "m"), "ZPOPMIN": ("z",), "ZREM": ("z", "m"),
    "ZSCORE": ("z", "m"), "PEXPIREAT": ("h", "1"), "PEXPIRETIME": ("h",), "ZCARD": ("z",), "ZRANGE": ("z", "0", "0"),
    "ZRANGEBYSCORE": ("z", "0", "1"), "ZREMRANGEBYSCORE": ("z", "0", "1"),
}


@dataclass(frozen=True)
class Check:
    """One line of the report.

    `state`: what was found: "ok", "missing", "unknown", or the value itself
    ("allkeys-lru", "7.0.15", "replica", ...). `verdict`: what follows.
    `fix`: the exact command or ACL rule that fixes it, when something is wrong.
    """

    name: str
    state: str
    verdict: Verdict
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class ServerReport:
    """The facts about one server and the checks that follow from them; None where unknown."""

    address: str | None
    server: str | None
    version: str | None
    user: str | None
    maxmemory: int | None
    maxmemory_policy: str | None
    used_memory: int | None
    aof: bool | None
    rdb_save: str | None
    role: str | None
    replicas: int | None
    cluster: bool | None
    round_trip: float | None  # seconds, the median of a few PINGs
    checks: tuple[Check, ...]

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    @property
    def refusals(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.verdict == "refusal")

    @property
    def warnings(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.verdict == "warning")

    @property
    def ok(self) -> bool:
        """Nothing refused: the manager may use this server."""
        return not self.refusals

    @property
    def evicting(self) -> bool | None:
        """Could Redis evict a held lock? None when the policy is unknown."""
        if self.maxmemory_policy is None:
            return None
        return self.maxmemory_policy != "noeviction"

    @property
    def can_subscribe(self) -> bool:
        """False only when the wake channels are known to be refused: then the manager polls."""
        return self.check("channels").state != "missing"

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (`otel-lock doctor --json`, a health endpoint)."""
        return {**asdict(self), "ok": self.ok, "evicting": self.evicting}

    def refusal_message(self) -> str:
        where = f"Redis at {self.address}" if self.address else "Redis"
        return f"{where} cannot serve otel-lock: " + "; ".join(
            f"{c.detail}" + (f" (fix: {c.fix})" if c.fix else "") for c in self.refusals)

    def raise_for_refusals(self) -> None:
        """RedisMisconfigured naming every refusal and its fix, if there is one."""
        if self.refusals:
            raise RedisMisconfigured(self.refusal_message())

    def log(self, logger: logging.Logger = log) -> None:
        """One log line per warning (WARNING) and refusal (ERROR); nothing when all is well."""
        where = self.address or "Redis"
        for c in self.checks:
            if c.verdict in ("warning", "refusal"):
                level = logging.ERROR if c.verdict == "refusal" else logging.WARNING
                logger.log(level, "otel-lock: %s: %s: %s%s", where, c.name, c.detail,
                           f" (fix: {c.fix})" if c.fix else "")


@dataclass(frozen=True)
class ServerHealth:
    """A manager's current verdict on its server(s), for an app's health endpoint (`manager.health()`).

    `ok`: the manager may take locks: no server check refuses, and the
    namespace is not another data model's (True until the first use has
    checked). `problems`: each refusal and warning on one line, with its fix.
    `namespace_model`: the data model the namespace was last found in
    (None: not read yet), `model`: this manager's.
    """

    ok: bool
    checked: bool
    problems: tuple[str, ...]
    model: int
    namespace_model: int | None
    servers: tuple[ServerReport, ...]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {"ok": self.ok, "checked": self.checked, "problems": list(self.problems), "model": self.model,
                "namespace_model": self.namespace_model, "servers": [r.as_dict() for r in self.servers]}


async def server_identity(run: Run) -> tuple[str | None, str | None]:
    """(run_id, role) of the server `run` reaches: another run_id is a restart, another role a failover.

    One `INFO server replication` (Redis 7.0+); (None, None) when INFO is refused.
    """
    info = await _info(run, "server", "replication")
    return _text(info.get("run_id")) or None, _role(info.get("role"))


async def check_server(run: Run, *, namespace: str = "otel-lock", cluster: bool | None = None,
                       require_noeviction: bool = False, subscribe: Callable[[str], Awaitable[Any]] | None = None,
                       address: str | None = None, pings: int = 3) -> ServerReport:
    """Check one server (one Cluster master) for a lock manager of `namespace`.

    `run(*args)` sends one command and returns its reply. `cluster`: True for
    a Redis Cluster node (wake-ups by SPUBLISH/SSUBSCRIBE); None reads it from
    INFO. `subscribe(channel)`, if given, subscribes to `channel` (SSUBSCRIBE
    on a Cluster) on a connection of its own and leaves it, raising if
    refused; without it, and without ACL DRYRUN, the right to subscribe is
    unknown. Connection errors propagate: no report without a server.
    """
    round_trip, ping = await _round_trip(run, pings)
    info = await _info(run)
    config = await _config(run, info)
    node = _int(info.get("cluster_enabled")) == 1 if info else None
    asked_plain = cluster is False and node is True  # a Cluster node behind a plain (or RedLock) URL
    if cluster is None:
        cluster = node
    user = _text(await _try(run, "ACL", "WHOAMI")) or None
    rights = _Rights(run, namespace, bool(cluster), user, subscribe)
    await rights.probe()
    server, version = _server_and_version(info)
    maxmemory = _int(info.get("maxmemory", config.get("maxmemory")))
    policy = _text(info.get("maxmemory_policy", config.get("maxmemory-policy"))) or None
    used = _int(info.get("used_memory"))
    aof_enabled = info.get("aof_enabled", config.get("appendonly"))
    aof = None if aof_enabled is None else _text(aof_enabled) in ("1", "yes")
    rdb_save = config.get("save")
    role = _role(info.get("role"))
    replicas = _int(info.get("connected_slaves"))
    checks = (
        _version_check(server, version),
        _eviction_check(policy, maxmemory, require_noeviction),
        _memory_check(maxmemory, used),
        _persistence_check(aof, _text(config.get("appendfsync")) or None,
                           None if rdb_save is None else _text(rdb_save)),
        _replication_check(role, replicas),
        *rights.checks(),
        _round_trip_check(round_trip, ping, user),
        *([_cluster_node_check(address)] if asked_plain else []),
    )
    return ServerReport(address, server, version, user, maxmemory, policy, used, aof,
                        None if rdb_save is None else _text(rdb_save), role, replicas, cluster, round_trip, checks)


# -- reading the server ---------------------------------------------------------


async def _round_trip(run: Run, pings: int) -> tuple[float, BaseException | None]:
    """The median PING round trip; a refused PING is timed too (it is a round trip) and returned."""
    times, refused = [], None
    for _ in range(max(1, pings)):
        began = time.perf_counter()
        try:
            await run("PING")
        except Exception as exc:  # noqa: BLE001 - classified below; connection errors re-raised
            if not _refused(exc):
                raise
            refused = exc
        times.append(time.perf_counter() - began)
    return statistics.median(times), refused


async def _try(run: Run, *args: Any) -> Any:
    """The reply, or None when the server refused the command (unknown, renamed, not allowed)."""
    try:
        return await run(*args)
    except Exception as exc:  # noqa: BLE001
        if _answered(exc):
            return None
        raise


async def _info(run: Run, *sections: str) -> dict[str, Any]:
    reply = await _try(run, "INFO", *sections)
    if isinstance(reply, dict):  # redis-py parsed it
        return {str(k): v for k, v in reply.items()}
    fields: dict[str, Any] = {}
    for line in _text(reply).splitlines():
        key, sep, value = line.partition(":")
        if sep and not key.startswith("#"):
            fields[key.strip()] = value.strip()
    return fields


async def _config(run: Run, info: dict[str, Any]) -> dict[str, Any]:
    """CONFIG GET of what INFO does not publish (the save schedule, appendfsync, a hidden policy)."""
    wanted = ["save", "appendfsync"]
    wanted += [k for k, i in (("maxmemory-policy", "maxmemory_policy"), ("maxmemory", "maxmemory"),
                              ("appendonly", "aof_enabled")) if i not in info]
    reply = await _try(run, "CONFIG", "GET", *wanted)
    if isinstance(reply, dict):
        return {_text(k): v for k, v in reply.items()}
    if isinstance(reply, list):
        return {_text(k): v for k, v in zip(reply[::2], reply[1::2])}
    return {}


def _server_and_version(info: dict[str, Any]) -> tuple[str | None, str | None]:
    if "valkey_version" in info:
        return "valkey", _text(info["valkey_version"])
    for other in ("dragonfly", "keydb"):
        if f"{other}_version" in info:
            return other, _text(info[f"{other}_version"])
    if "server_name" in info:
        return _text(info["server_name"]).lower(), _text(info.get("redis_version")) or None
    if "redis_version" in info:
        return "redis", _text(info["redis_version"])
    return None, None


def _role(value: Any) -> str | None:
    role = _text(value) or None
    return "replica" if role == "slave" else role


# -- the checks -------------------------------------------------------------------


def _version_check(server: str | None, version: str | None) -> Check:
    if server is None or version is None:
        return Check("version", "unknown", "note", "INFO publishes no server version; the supported servers are "
                     "Redis 7.0+ and Valkey 8+")
    numbers = _version_tuple(version)
    label = f"{'Valkey' if server == 'valkey' else server.capitalize()} {version}"
    minimum = {"redis": MIN_REDIS, "valkey": MIN_VALKEY}.get(server)
    if minimum is None:
        return Check("version", version, "warning", f"{label} is not a server otel-lock is tested on "
                     "(Redis 7.0+, Valkey 8+)")
    if numbers < minimum:
        needed = ".".join(map(str, minimum))
        return Check("version", version, "refusal", f"{label} is older than the supported minimum "
                     f"({label.split()[0]} {needed})", f"upgrade to Redis 7.0+ or Valkey 8+")
    return Check("version", version, "ok", f"{label} (supported: Redis 7.0+, Valkey 8+)")


def _eviction_check(policy: str | None, maxmemory: int | None, require: bool) -> Check:
    fix = "CONFIG SET maxmemory-policy noeviction (or a Redis of its own for the locks)"
    if policy is None:
        detail = "the eviction policy is unknown (INFO publishes no maxmemory_policy and CONFIG GET is refused)"
        if require:
            return Check("eviction", "unknown", "refusal", detail + "; require_noeviction=True needs it proven",
                         fix)
        return Check("eviction", "unknown", "note", detail + ": make sure it is noeviction")
    if policy == "noeviction":
        return Check("eviction", policy, "ok", "maxmemory-policy noeviction: Redis never evicts a held lock")
    verdict: Verdict = "refusal" if require else "warning"
    if maxmemory == 0:
        return Check("eviction", policy, "refusal" if require else "note",
                     f"maxmemory-policy {policy}, but no maxmemory is set: nothing is evicted until one is", fix)
    return Check("eviction", policy, verdict,
                 f"maxmemory-policy {policy}: under memory pressure Redis evicts held locks and grants them "
                 "again; the holder is told at its next renewal (docs/lock.md, \"Eviction\")", fix)


def _memory_check(maxmemory: int | None, used: int | None) -> Check:
    if maxmemory is None:
        return Check("memory", "unknown", "note", "maxmemory is unknown")
    if maxmemory == 0:
        return Check("memory", "no limit", "ok", "no maxmemory: Redis may use all the host's memory"
                     + (f" (uses {_size(used)})" if used is not None else ""))
    if used is None:
        return Check("memory", _size(maxmemory), "note", f"maxmemory {_size(maxmemory)}, use unknown")
    share = used / maxmemory
    detail = f"uses {_size(used)} of maxmemory {_size(maxmemory)} ({share:.0%})"
    if share >= 0.9:
        return Check("memory", f"{share:.0%}", "warning", detail + ": near the limit, writes fail with OOM or "
                     "keys are evicted", "raise maxmemory, or keep other data off the locks' Redis")
    return Check("memory", f"{share:.0%}", "ok", detail)


def _persistence_check(aof: bool | None, fsync: str | None, save: str | None) -> Check:
    if aof:
        state = f"aof ({fsync})" if fsync else "aof"
        safe = fsync == "always"
        return Check("persistence", state, "ok" if safe else "note",
                     f"AOF on{f', appendfsync {fsync}' if fsync else ''}: held locks survive a restart"
                     + ("" if safe else ", except those of the last second before a crash"))
    if aof is None:
        return Check("persistence", "unknown", "note", "persistence is unknown (INFO and CONFIG say nothing)")
    snapshots = f"RDB snapshots ({save})" if save else ("no RDB snapshots" if save == "" else "RDB unknown")
    return Check("persistence", "rdb" if save else ("none" if save == "" else "no aof"), "note",
                 f"AOF off, {snapshots}: a restart forgets held locks; new grants are fenced "
                 "(docs/safety.md, \"Restart without persistence\")")


def _replication_check(role: str | None, replicas: int | None) -> Check:
    if role is None:
        return Check("replication", "unknown", "note", "the replication role is unknown")
    if role == "replica":
        return Check("replication", role, "warning", "this server is a replica: lock writes fail (READONLY)",
                     "point the manager at the master, or use a redis+sentinel:// URL")
    count = "no replicas" if not replicas else f"{replicas} replica{'s' if replicas > 1 else ''}"
    return Check("replication", role, "ok", f"{role}, {count}")


def _cluster_node_check(address: str | None) -> Check:
    """A Cluster node used as one Redis answers MOVED for the other nodes' slots: refuse it by name at once."""
    return Check("topology", "cluster node", "refusal", "this server is a Redis Cluster node, reached as a single "
                 "Redis: the keys of other nodes' slots would be answered MOVED",
                 f"use redis+cluster://{address or 'host:port'} (or a RedisCluster client) with LockManager")


def _round_trip_check(round_trip: float, refused: BaseException | None, user: str | None) -> Check:
    ms = f"{round_trip * 1000:.2f} ms"
    if refused is not None:
        return Check("round trip", "missing", "warning", f"PING refused ({_first_line(refused)}); the "
                     "subscriber uses it to check its connection", f"ACL SETUSER {user or '<user>'} +ping")
    return Check("round trip", ms, "ok", f"PING answered in {ms} (median)")


# -- ACL rights -------------------------------------------------------------------


class _Rights:
    """Scripts, keys and channels: by ACL DRYRUN when allowed, else by trying them."""

    def __init__(self, run: Run, namespace: str, cluster: bool, user: str | None,
                 subscribe: Callable[[str], Awaitable[Any]] | None) -> None:
        self.run, self.user, self.cluster, self.subscribe = run, user, cluster, subscribe
        self.pattern = _glob_escape(namespace)
        self.keys = tuple(f"{namespace}:{_PROBE_TAG}:check-{kind}" for kind in "hsz")
        self.channel = f"{namespace}:{_PROBE_CHANNEL}"
        self.publish, self.sub = ("SPUBLISH", "SSUBSCRIBE") if cluster else ("PUBLISH", "SUBSCRIBE")
        # command (lower case) -> None allowed, str the refusal; absent: unknown
        self.commands: dict[str, str | None] = {}
        self.keys_refused: str | None | bool = False  # False: unknown
        self.channel_refused: str | None | bool = False
        self.how = "unknown"

    async def probe(self) -> None:
        if self.cluster:
            await self._own_slot()
        if self.user is not None and _is_ok(await _try(self.run, "ACL", "DRYRUN", self.user, "PING")):
            self.how = "ACL DRYRUN"
            await self._dryrun()
            # The ACL may allow what rename-command took away (DRYRUN then errs): SCRIPT LOAD is tried for
            # real, and EVAL, the lock's way without it, too when DRYRUN could not tell.
            if not await self._load() and "eval" not in self.commands:
                await self._probe("EVAL")
        else:
            self.how = "trying the commands"
            await self._try_commands()
        if self.subscribe is not None and self.sub.lower() not in self.commands:
            try:
                await self.subscribe(self.channel)
                self._note(self.sub, None)
            except Exception as exc:  # noqa: BLE001
                if not _refused(exc):
                    raise
                self._note(self.sub, _first_line(exc))

    async def _own_slot(self) -> None:
        """On a Cluster node, probe keys and channel in a slot this node serves (else: MOVED)."""
        from ._cluster import slot_tag

        slot = _first_own_slot(await _try(self.run, "CLUSTER", "NODES"))
        if slot is None:
            return
        tag = "{" + slot_tag(slot) + "}"
        namespace = self.keys[0].split(":" + _PROBE_TAG, 1)[0]
        self.keys = tuple(f"{namespace}:{tag}:check-{kind}" for kind in "hsz")
        self.channel = f"{namespace}:{_PROBE_CHANNEL}:{tag}"

    async def _dryrun(self) -> None:
        keys = dict(zip("hsz", self.keys))
        probe = ("3", *self.keys, self.channel, self.publish)
        calls = [("EVALSHA", _PROBE_SHA, *probe), ("EVAL", _PROBE, *probe), (self.publish, self.channel, "m"),
                 (self.sub, self.channel)]
        calls += [(c, *(keys.get(a, a) for a in args)) for c, args in _DRYRUN_ARGS.items()]
        for call in calls:
            reply = await _try(self.run, "ACL", "DRYRUN", self.user, *call)
            if reply is None:  # a command this server does not have (SPUBLISH before 7.0): unknown
                continue
            answer = _text(reply)
            self._note(call[0], None if _is_ok(answer) else answer)
        if self.keys_refused is False and self._unknown(tuple(c.lower() for c in SCRIPT_COMMANDS)) == []:
            self.keys_refused = None  # every command was asked with the namespace's keys, none refused them

    async def _try_commands(self) -> None:
        """SCRIPT LOAD, then the probe by EVALSHA; by EVAL when the load was refused (the lock's own fallback)."""
        await self._load()  # cached already or not: SCRIPT LOAD is tried in any case
        if not await self._probe("EVALSHA"):
            await self._probe("EVAL")

    async def _probe(self, command: str) -> bool:
        """Run the probe by EVALSHA or EVAL and note what it found; False when the other way may tell more."""
        body = _PROBE_SHA if command == "EVALSHA" else _PROBE
        try:
            denied = await self.run(command, body, "3", *self.keys, self.channel, self.publish)
        except Exception as exc:  # noqa: BLE001
            if not _answered(exc):
                raise
            if str(exc).startswith(("MOVED", "ASK")):
                return True  # a Cluster node that would not say which slots it serves (CLUSTER NODES): unknown
            if isinstance(exc, NoScriptError) or str(exc).startswith("NOSCRIPT"):
                # not loaded (SCRIPT LOAD was refused), but the ACL let EVALSHA and its keys through
                self._note("EVALSHA", None)
                self.keys_refused = None
            elif _refused(exc):
                self._note(command, _first_line(exc))
            else:
                raise
            return False
        self._note(command, None)
        self.keys_refused = None
        self.channel_refused = None
        refused = dict(zip(map(_text, denied[::2]), map(_text, denied[1::2])))
        for name in (*SCRIPT_COMMANDS, self.publish):
            self._note(name, refused.get(name))
        return True

    async def _load(self) -> bool:
        try:
            await self.run("SCRIPT", "LOAD", _PROBE)
        except Exception as exc:  # noqa: BLE001
            if not _refused(exc):
                raise
            self.commands["script load"] = _first_line(exc)  # never about keys or channels: SCRIPT has none
            return False
        self._note("SCRIPT LOAD", None)
        return True

    def _note(self, command: str, refusal: str | None) -> None:
        """Record one answer. A refusal that names a key or a channel is about those: the command passed."""
        text = (refusal or "").lower()
        if refusal is not None and re.search(r"\bkeys?\b", text):
            self.keys_refused, refusal = refusal, None
        elif refusal is not None and re.search(r"\bchannels?\b", text):
            self.channel_refused, refusal = refusal, None
        elif refusal is None and command in (self.publish, self.sub) and self.channel_refused is False:
            self.channel_refused = None
        elif refusal is None and command == "EVALSHA" and self.keys_refused is False and self.how == "ACL DRYRUN":
            self.keys_refused = None
        self.commands[command.lower()] = refusal

    def checks(self) -> tuple[Check, Check, Check]:
        return self._scripts(), self._keys(), self._channels()

    def _rule(self, *parts: str) -> str:
        return f"ACL SETUSER {self.user or '<user>'} " + " ".join(parts)

    def _missing(self, commands: tuple[str, ...]) -> list[str]:
        return [c for c in commands if self.commands.get(c) is not None]

    def _unknown(self, commands: tuple[str, ...]) -> list[str]:
        return [c for c in commands if c not in self.commands]

    def _scripts(self) -> Check:
        """EVALSHA runs every script; SCRIPT LOAD, or else EVAL, gives Redis a script it does not have."""
        evalsha, load, eval_ = (self.commands.get(c, "") for c in ("evalsha", "script load", "eval"))
        if evalsha:
            return Check("scripts", "missing", "refusal", "the user may not run EVALSHA: the lock runs its Lua "
                         "scripts by SHA", self._rule("+evalsha"))
        if load and eval_:
            renamed = "unknown command" in load.lower()
            return Check("scripts", "missing", "refusal", f"neither SCRIPT LOAD ({_first_line(load)}) nor EVAL "
                         f"({_first_line(eval_)}) may run: the lock cannot give Redis its scripts after a restart",
                         self._rule("+eval" if renamed else "+script|load"))
        if "evalsha" not in self.commands or "script load" not in self.commands:
            return Check("scripts", "unknown", "note", "could not tell whether EVALSHA and SCRIPT LOAD are allowed")
        if load is None:
            return Check("scripts", "ok", "ok", f"EVALSHA and SCRIPT LOAD allowed ({self.how})")
        if eval_ is None:
            return Check("scripts", "eval", "note", f"SCRIPT LOAD is not available ({_first_line(load)}): the "
                         "lock sends a script Redis lacks (after a restart or failover) by EVAL, then runs it by "
                         f"EVALSHA; EVALSHA and EVAL allowed ({self.how})")
        return Check("scripts", "unknown", "note", f"SCRIPT LOAD is not available ({_first_line(load)}) and "
                     "whether EVAL is allowed is unknown: the lock needs one of them after a restart",
                     self._rule("+eval"))

    def _keys(self) -> Check:
        where = f"{self.pattern}:*"
        if isinstance(self.keys_refused, str):
            return Check("keys", "missing", "refusal", f"the user may not write keys {where}: "
                         f"{_first_line(self.keys_refused)}", self._rule(f"~{where}"))
        commands = tuple(c.lower() for c in SCRIPT_COMMANDS)
        missing = self._missing(commands)
        if missing:
            return Check("keys", "missing", "refusal", f"the lock's scripts run {', '.join(m.upper() for m in missing)}, "
                         "which the user may not", self._rule(*("+" + m for m in missing)))
        if self.keys_refused is False or self._unknown(commands):
            return Check("keys", "unknown", "note", f"could not tell whether the user may use keys {where}")
        return Check("keys", "ok", "ok", f"keys {where} and the scripts' {len(commands)} commands allowed")

    def _channels(self) -> Check:
        where = f"{self.pattern}:wake:*"
        commands = (self.publish.lower(), self.sub.lower())
        missing = self._missing(commands)
        if isinstance(self.channel_refused, str) or missing:
            rule = ([f"&{where}"] if isinstance(self.channel_refused, str) else []) + ["+" + m for m in missing]
            what = f"use the channels {where}" if isinstance(self.channel_refused, str) else \
                "run " + " or ".join(m.upper() for m in missing)
            return Check("channels", "missing", "warning", f"the user may not {what}: the manager polls "
                         "instead of being woken (slower hand-overs)", self._rule(*rule))
        if self.channel_refused is False or self._unknown(commands):
            return Check("channels", "unknown", "note", f"could not tell whether {commands[1].upper()} on {where} "
                         "is allowed")
        return Check("channels", "ok", "ok", f"{' and '.join(c.upper() for c in commands)} on {where} allowed")


# -- small helpers ------------------------------------------------------------------


def _first_own_slot(reply: Any) -> int | None:
    """The first slot the answering node serves, from CLUSTER NODES (redis-py's parsed dict or the text)."""
    if isinstance(reply, dict):
        for node in reply.values():
            if isinstance(node, dict) and "myself" in _text(node.get("flags")) and node.get("slots"):
                return int(_text(node["slots"][0][0]))
        return None
    for line in _text(reply).splitlines():
        fields = line.split()
        if len(fields) > 8 and "myself" in fields[2]:
            for part in fields[8:]:
                if part[:1].isdigit():
                    return int(part.split("-")[0])
    return None


def _answered(exc: BaseException) -> bool:
    """Did the server answer (an error reply), as opposed to a broken or refused connection?"""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
        return False
    return isinstance(exc, (ResponseError, RedisMisconfigured)) or "NOPERM" in str(exc)


def _refused(exc: BaseException) -> bool:
    """An ACL refusal, or a command the server lacks: what the rights checks report, with its fix.

    Any other error reply (DB index is out of range, LOADING, OOM) is about
    the server, not the user's rights: raised, so that it is named as itself
    instead of as ACL fixes that do not apply.
    """
    if not _answered(exc):
        return False
    text = str(exc).lower()
    return script_refused(exc) or any(words in text for words in _REFUSALS)


# Beside script_refused's NOPERM and unknown command: ACL wording without the code, a script's refused call,
# a subcommand the server lacks
_REFUSALS = ("no permissions", "user executing the script can't", "unknown subcommand")


def _is_ok(reply: Any) -> bool:
    return reply is True or _text(reply) == "OK"


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def _int(value: Any) -> int | None:
    try:
        return int(_text(value))
    except ValueError:
        return None


def _version_tuple(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{n}B"


def _first_line(value: BaseException | str) -> str:
    """The first line, without the arguments an unknown-command error echoes (a whole script, for SCRIPT LOAD)."""
    line = (str(value).strip().splitlines() or [type(value).__name__])[0]
    return line.split(", with args beginning with", 1)[0]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
