"""Every instrument otel-lock records, in one table: OTel name, unit, labels, buckets.

Both recording paths read it: the OpenTelemetry SDK instruments
(`_instruments.Telemetry`) and the prometheus-client fast path (`_prom`), so
the two cannot drift apart. `prom` is the default OTel -> Prometheus
translation of the name (dots to underscores, unit suffix), which is what
the SDK's Prometheus reader and the collector's `prometheus` exporter
produce, and what the alert rules and dashboards query.
"""

from __future__ import annotations

from dataclasses import dataclass

# Boundaries fall on the alert thresholds (wait p95 0.5 s), so
# histogram_quantile() is exact at the line that pages instead of
# interpolated across a wide bucket. Hold time against the lease is alerted
# on the hold-age gauge, not on this histogram.
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Redis round trips of the lock scripts: sub-millisecond on a LAN, 1 s = the
# edge of the default socket timeout (2 s).
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Spec:
    attr: str                      # attribute of Telemetry the core calls
    name: str                      # OpenTelemetry instrument name
    kind: str                      # histogram | counter
    unit: str
    prom: str                      # Prometheus family name (without _total/_bucket suffixes)
    labels: tuple[str, ...]        # OTel attribute names, in Prometheus label order
    description: str
    buckets: tuple[float, ...] = ()


RECORDED = (
    Spec("wait_duration", "otel_lock.wait.duration", "histogram", "s", "otel_lock_wait_duration_seconds",
         ("lock.name", "lock.outcome", "lock.contended", "error.type", "lock.mode"),
         "Time from asking for a lock to getting it or giving up.", WAIT_BUCKETS),
    Spec("hold_duration", "otel_lock.hold.duration", "histogram", "s", "otel_lock_hold_duration_seconds",
         ("lock.name", "lock.release.outcome", "lock.mode"),
         "Time a lock was held, from acquire to release or loss.", HOLD_BUCKETS),
    Spec("errors", "otel_lock.errors", "counter", "{error}", "otel_lock_errors",
         ("lock.name", "lock.operation", "error.type"),
         "Failed lock operations by operation and error type."),
    Spec("renewals", "otel_lock.renewals", "counter", "{renewal}", "otel_lock_renewals",
         ("lock.name", "lock.renewal.outcome", "lock.mode"),
         "Lease renewals by outcome (ok, lost, error)."),
    Spec("idempotency_requests", "otel_lock.idempotency.requests", "counter", "{request}",
         "otel_lock_idempotency_requests", ("http.route", "idempotency.outcome"),
         "Requests carrying an Idempotency-Key by outcome."),
    Spec("redis_duration", "otel_lock.redis.operation.duration", "histogram", "s",
         "otel_lock_redis_operation_duration_seconds", ("lock.name", "lock.operation", "error.type"),
         "Redis round trip of one lock script (acquire, release, renew, leave), "
         "modelled on db.client.operation.duration.", REDIS_BUCKETS),
    Spec("circuit_opened", "otel_lock.circuit.opened", "counter", "{opening}", "otel_lock_circuit_opened",
         ("db.client.connection.pool.name",),
         "Times a manager's circuit breaker opened after consecutive Redis-unavailable errors."),
    Spec("fail_open", "otel_lock.fail_open", "counter", "{request}", "otel_lock_fail_open",
         ("lock.name",),
         "Requests of fail_open routes that ran without their lock because Redis was unavailable."),
    Spec("periodic_runs", "otel_lock.periodic.runs", "counter", "{run}", "otel_lock_periodic_runs",
         ("lock.name", "periodic.outcome"),
         "Ticks of once-per-period jobs by outcome: ran, skipped (another replica had it), failed, unavailable."),
)


@dataclass(frozen=True)
class GaugeSpec:
    name: str
    kind: str                      # updowncounter | gauge
    unit: str
    prom: str
    description: str
    labels: tuple[str, ...] = ("lock.name",)


OBSERVED = {
    "active": GaugeSpec("otel_lock.active", "updowncounter", "{lock}", "otel_lock_active",
                        "Locks held by this process right now (expired holds not counted)."),
    "pending": GaugeSpec("otel_lock.pending", "updowncounter", "{request}", "otel_lock_pending",
                         "Callers waiting for a lock in this process."),
    "hold_age": GaugeSpec("otel_lock.hold.age", "gauge", "s", "otel_lock_hold_age_seconds",
                          "Age of the oldest hold of each lock name in this process."),
    "lease": GaugeSpec("otel_lock.lease", "gauge", "s", "otel_lock_lease_seconds",
                       "Lease of that oldest hold (the time it may go unrenewed)."),
    "connections": GaugeSpec("otel_lock.redis.connection.count", "updowncounter", "{connection}",
                             "otel_lock_redis_connection_count",
                             "Redis connections open for the lock managers (state=used), "
                             "as db.client.connection.count.",
                             ("db.client.connection.state", "db.client.connection.pool.name")),
    "connection_pending": GaugeSpec("otel_lock.redis.connection.pending_requests", "updowncounter",
                                    "{request}", "otel_lock_redis_connection_pending_requests",
                                    "Lock commands sent or queued and not yet answered, "
                                    "as db.client.connection.pending_requests.", ("db.client.connection.pool.name",)),
    "circuit_state": GaugeSpec("otel_lock.circuit.state", "gauge", "{state}", "otel_lock_circuit_state",
                               "Circuit breaker of the lock managers: 0 closed, 1 open (acquisitions "
                               "fail at once), 2 half-open (a probe may pass).", ("db.client.connection.pool.name",)),
    "permits_used": GaugeSpec("otel_lock.permits.used", "gauge", "{permit}", "otel_lock_permits_used",
                              "Permits of each semaphore held by this process right now."),
    "permits_limit": GaugeSpec("otel_lock.permits.limit", "gauge", "{permit}", "otel_lock_permits_limit",
                               "The permits limit of each semaphore this process has held (saturated when the "
                               "sum of otel_lock.permits.used over processes reaches it)."),
    "server_verdict": GaugeSpec("otel_lock.server.verdict", "gauge", "{verdict}", "otel_lock_server_verdict",
                                "The server checks' current verdict per server: 0 usable, 1 usable with "
                                "warnings, 2 refused (acquisitions fail: a refused check or another data model).",
                                ("db.client.connection.pool.name", "server.address")),
}


# Series created at 0 before their first event: increase() and rate() need
# an earlier sample, so a counter born at its first event (a replica's first
# lost lease, first Redis errors after a restart) would page late or never.
# Per lock name, when a manager first sees it (its first hold or wait); the
# attribute order is the core's, so the fast path's cache keys match.
NAME_SEEDS: tuple[tuple[str, dict[str, object]], ...] = (
    ("renewals", {"lock.renewal.outcome": "ok"}),
    ("renewals", {"lock.renewal.outcome": "lost"}),
    ("renewals", {"lock.renewal.outcome": "error"}),
    ("wait_duration", {"lock.outcome": "acquired", "lock.contended": False}),
    ("wait_duration", {"lock.outcome": "acquired", "lock.contended": True}),
    ("wait_duration", {"lock.outcome": "timeout", "lock.contended": True}),
    # a refused deadlock (LockDeadlock): OtelLockDeadlocks pages on the first
    ("errors", {"lock.operation": "acquire", "error.type": "deadlock"}),
)
# Per manager, when it starts: Redis errors by operation and type (no lock
# name: the first errors may come before any name is seen, with Redis down
# from the start), and circuit openings of its pool.
ERROR_SEEDS: tuple[dict[str, object], ...] = tuple(
    {"lock.operation": operation, "error.type": kind}
    for operation in ("acquire", "release", "renew", "leave")
    for kind in ("redis_unavailable", "redis_misconfigured", "redis_error"))
POOL_SEED = "circuit_opened"


def prom_label(attribute: str) -> str:
    return attribute.replace(".", "_")


def prom_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)
