"""Build the Grafana dashboards of otel-lock as JSON, from code.

    python dashboards/generate.py          # rewrites dashboards/*.json
    python dashboards/generate.py --check  # exit 1 if the committed JSON is stale

Why code: every panel then uses the same datasource uid, `$__rate_interval`
and metric names, and tests can walk `DASHBOARDS` to run every query
against a real Prometheus. Metric names are the default OpenTelemetry ->
Prometheus translation of DESIGN §2.4, checked by scraping real replicas.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULES = HERE.parent / "deploy" / "prometheus" / "rules" / "otel-lock.rules.yml"
# The Prometheus datasource is a variable, so the dashboards import into any
# Grafana; deploy/grafana/provisioning names its default `prometheus`.
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
DEFAULT_LEASE = 30  # seconds: drawn beside hold time
RATE = "[$__rate_interval]"
# Every selector is narrowed to the chosen services and replicas.
SCOPE = 'job=~"$job",instance=~"$instance"'
DRILL_DOWN = ("/d/otel-lock-lock/otel-lock-lock?var-lock_name=${__field.labels.lock_name}"
              "&${job:queryparam}&${instance:queryparam}&${datasource:queryparam}&${__url_time_range}")

WAIT = "otel_lock_wait_duration_seconds"
HOLD = "otel_lock_hold_duration_seconds"
REDIS = "otel_lock_redis_operation_duration_seconds"


def sel(*matchers: str) -> str:
    """`{job=~"$job",instance=~"$instance",<matchers>}`"""
    return "{" + ",".join((SCOPE, *matchers)) + "}"


def born(series: str, window: str = "$__rate_interval") -> str:
    """Increase of a counter over `window`, a series born inside it counted whole.

    A counter series appears with its first event already counted (born at
    1), so `rate()`/`increase()` have no earlier sample and miss it: a
    replica's first lost lease, circuit opening or 503 would never be drawn.
    A series that did not exist `window` ago contributes its whole value.
    """
    return f"(({series} unless {series} offset {window}) or increase({series}[{window}]))"


def events_per_second(by: str, series: str) -> str:
    """`sum by (by) (rate(series))`, first events included (see `born`)."""
    return f"sum by ({by}) ({born(series)}) / ($__rate_interval_ms / 1000)"


def variables(lock_name: bool = False) -> list[dict]:
    found = [{"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
              "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []}]
    for name, label, query in (("job", "service", f"label_values({WAIT}_count, job)"),
                               ("instance", "replica", f'label_values({WAIT}_count{{job=~"$job"}}, instance)')):
        found.append({"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
                      "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "sort": 1,
                      "multi": True, "includeAll": True, "allValue": ".*",
                      "current": {"text": "All", "value": "$__all"}})
    if lock_name:
        query = f'label_values({WAIT}_count{{job=~"$job"}}, lock_name)'
        found.append({"name": "lock_name", "label": "lock", "type": "query", "datasource": DATASOURCE,
                      "query": {"query": query, "refId": "lock_name"}, "definition": query,
                      "refresh": 2, "sort": 1, "multi": False, "includeAll": False, "current": {}})
    return found


def leases_lost(scope: str = SCOPE) -> str:
    """The OtelLockLeaseLost expression (both arms, born-at-1 series counted) over the dashboard range.

    Read from the rules file, so the stat and the alert cannot disagree.
    """
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    [expr] = [rule["expr"] for group in groups for rule in group["rules"] if rule.get("alert") == "OtelLockLeaseLost"]
    expr = expr.strip()
    assert expr.endswith("> 0"), expr
    expr = expr[: -len("> 0")].strip().replace("[10m]", "[$__range]").replace("offset 10m", "offset $__range")
    expr = expr.replace('{lock_renewal_outcome="lost"}', "{" + scope + ',lock_renewal_outcome="lost"}')
    expr = expr.replace('{lock_release_outcome=~"lost|expired"}', "{" + scope + ',lock_release_outcome=~"lost|expired"}')
    return f"round(sum({expr})) or vector(0)"


# -- panel helpers -----------------------------------------------------------


def target(expr: str, legend: str = "", ref: str = "A", **extra) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, "range": True, **extra}


def timeseries(title: str, description: str, targets: list[dict], unit: str = "short", *,
               overrides: list | None = None, thresholds: list | None = None, links: bool = False,
               stack: bool = False) -> dict:
    defaults: dict = {
        "unit": unit,
        "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                   "stacking": {"mode": "normal" if stack else "none", "group": "A"}},
    }
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
        defaults["custom"]["thresholdsStyle"] = {"mode": "line+area"}
    if links:
        defaults["links"] = [{"title": "Drill down into ${__field.labels.lock_name}", "url": DRILL_DOWN}]
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def stat(title: str, description: str, targets: list[dict], unit: str = "short", *, red_above: float = 0) -> dict:
    return {
        "type": "stat", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "color": {"mode": "thresholds"},
                                     "thresholds": {"mode": "absolute", "steps": [
                                         {"color": "green", "value": None}, {"color": "red", "value": red_above}]}},
                        "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background", "graphMode": "area"},
    }


def table(title: str, description: str, targets: list[dict], columns: dict[str, tuple[str, str]]) -> dict:
    """Instant queries joined on their labels; `columns`: Value #ref -> (header, unit)."""
    overrides = [{"matcher": {"id": "byName", "options": f"Value #{ref}"},
                  "properties": [{"id": "displayName", "value": header}, {"id": "unit", "value": unit}]}
                 for ref, (header, unit) in columns.items()]
    return {
        "type": "table", "title": title, "description": description, "datasource": DATASOURCE,
        "targets": [{**t, "instant": True, "range": False, "format": "table"} for t in targets],
        "fieldConfig": {"defaults": {}, "overrides": overrides},
        "transformations": [{"id": "merge", "options": {}},
                            {"id": "organize", "options": {"excludeByName": {"Time": True},
                                                           "renameByName": {"lock_name": "lock", "instance": "replica",
                                                                            "job": "service"}}}],
        "options": {"showHeader": True, "sortBy": [{"displayName": "held / lease", "desc": True}]},
    }


def heatmap(title: str, description: str, expr: str) -> dict:
    return {
        "type": "heatmap", "title": title, "description": description, "datasource": DATASOURCE,
        # Exemplars (trace ids on buckets) arrive through the collector; a dot links to the trace.
        "targets": [target(expr, "{{le}}", format="heatmap", exemplar=True)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"calculate": False, "yAxis": {"unit": "s"}, "cellGap": 1,
                    "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                    "exemplars": {"color": "rgba(255,0,255,0.7)"},
                    "tooltip": {"mode": "single", "yHistogram": True}, "legend": {"show": True}},
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def color(name: str, value: str, fixed: str) -> dict:
    """Override: series whose `name` label is `value` (legends end with it) are drawn in `fixed`."""
    return {"matcher": {"id": "byRegexp", "options": f"(^|.* ){value}$"},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": fixed}},
                           {"id": "custom.lineWidth", "value": 3}]}


def quantiles(metric: str, by: str, selector: str = sel(), qs=(0.5, 0.95, 0.99), exemplar: bool = False) -> list[dict]:
    return [
        target(f"histogram_quantile({q}, sum by ({by}le) (rate({metric}_bucket{selector}{RATE})))",
               f"p{int(q * 100)}" + (" {{lock_name}}" if "lock_name" in by else ""), chr(ord("A") + i),
               exemplar=exemplar)
        for i, q in enumerate(qs)
    ]


def by_mode(metric: str, by: str, selector: str, q: float = 0.95) -> list[dict]:
    """p`q` of `metric` by lock.mode; an exclusive lock's series have no `lock_mode` and read "exclusive"."""
    quantile = f"histogram_quantile({q}, sum by ({by}lock_mode, le) (rate({metric}_bucket{selector}{RATE})))"
    legend = ("{{lock_name}} " if "lock_name" in by else "") + "{{lock_mode}}"
    return [target(f'label_replace({quantile}, "lock_mode", "exclusive", "lock_mode", "")', legend)]


def permits(selector: str) -> list[dict]:
    """Permits in use (summed over replicas) and the limit, by lock: the two lines meet when a semaphore is full."""
    return [target(f"sum by (lock_name) (otel_lock_permits_used{selector})", "in use {{lock_name}}"),
            target(f"max by (lock_name) (otel_lock_permits_limit{selector})", "limit {{lock_name}}", "B")]


def layout(panels: list[dict]) -> list[dict]:
    """Rows span the width; other panels flow two per line (stats four per line)."""
    x = y = 0
    line_height = 0
    for number, panel in enumerate(panels, start=1):
        panel["id"] = number
        if panel["type"] == "row":
            y += line_height
            panel["gridPos"] = {"x": 0, "y": y, "w": 24, "h": 1}
            x, y, line_height = 0, y + 1, 0
            continue
        width, height = (6, 4) if panel["type"] == "stat" else (12, 8)
        if x + width > 24:
            x, y, line_height = 0, y + line_height, 0
        panel["gridPos"] = {"x": x, "y": y, "w": width, "h": height}
        x += width
        line_height = max(line_height, height)
    return panels


def dashboard(uid: str, title: str, description: str, panels: list[dict], variables: list[dict]) -> dict:
    return {
        "id": None, "uid": uid, "title": title, "description": description,
        "tags": ["otel-lock"], "timezone": "browser", "editable": False, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "refresh": "10s",
        "time": {"from": "now-15m", "to": "now"},
        "templating": {"list": list(variables)},
        "annotations": {"list": []},
        "links": [{"title": "otel-lock", "type": "dashboards", "tags": ["otel-lock"], "asDropdown": False}],
        "panels": layout(panels),
    }


# -- the lock overview -------------------------------------------------------

BUSY_GREY = "#8e8e8e"
NOT_BUSY = 'lock_outcome!="busy"'
ACQUIRED = 'lock_outcome="acquired"'
TIMEOUT = 'lock_outcome="timeout"'
CONTENDED = 'lock_contended="true"'
USED = 'db_client_connection_state="used"'
HTTP_ERRORS = 'http_status_code=~"[45].."'
DEADLOCK = 'error_type="deadlock"'


def outcome_colors() -> list[dict]:
    return [color("lock_outcome", "timeout", "orange"), color("lock_outcome", "error", "red"),
            color("lock_outcome", "busy", BUSY_GREY)]


def held_now() -> dict:
    return table(
        "Held now",
        "Every lock name held at this moment, per replica: age of its oldest current hold, the lease in "
        "force, and their ratio (OtelLockHoldNearLease warns above 0.8). A holder that never releases "
        "shows here long before any histogram sees it.",
        [target(f"max by (job, instance, lock_name) (otel_lock_hold_age_seconds{sel()})", ref="A"),
         target(f"max by (job, instance, lock_name) (otel_lock_lease_seconds{sel()})", ref="B"),
         target(f"max by (job, instance, lock_name) (otel_lock_hold_age_seconds{sel()} "
                f"/ otel_lock_lease_seconds{sel()})", ref="C")],
        {"A": ("held for", "s"), "B": ("lease", "s"), "C": ("held / lease", "percentunit")})


def redis_row(scope: str = "") -> list[dict]:
    by_op = sel(*([scope] if scope else []))
    return [
        row("Redis"),
        timeseries("Redis command latency p50 / p99 by operation",
                   "Round trip of each lock script to Redis (acquire, release, renew, leave), as "
                   "db.client.operation.duration: a slow Redis makes every lock slow.",
                   [target(f"histogram_quantile({q}, sum by (lock_operation, le) (rate({REDIS}_bucket{by_op}{RATE})))",
                           f"p{int(q * 100)} {{{{lock_operation}}}}", chr(ord('A') + i))
                    for i, q in enumerate((0.5, 0.99))], "s"),
        timeseries("Redis commands/s by operation and error.type",
                   "Lock scripts sent to Redis per second; failed ones carry error.type.",
                   [target(events_per_second("lock_operation, error_type", f"{REDIS}_count{by_op}"),
                           "{{lock_operation}} {{error_type}}")], "ops"),
        timeseries("Redis connections in use and pending requests",
                   "Connections the lock managers hold open (db.client.connection.count, state=used) and "
                   "lock commands sent and not yet answered (db.client.connection.pending_requests), per replica.",
                   [target(f"sum by (instance) (otel_lock_redis_connection_count{sel(USED)})",
                           "in use {{instance}}"),
                    target(f"sum by (instance) (otel_lock_redis_connection_pending_requests{sel()})",
                           "pending {{instance}}", "B")]),
        timeseries("Circuit breaker state and openings",
                   "Each lock manager's circuit breaker (otel_lock.circuit.state: 0 closed; 1 open, new "
                   "acquisitions fail at once without asking Redis; 2 half-open, the next acquisition probes) "
                   "and how often it opened, per replica. Open for a minute pages (OtelLockCircuitOpen).",
                   [target(f"max by (instance, db_client_connection_pool_name) (otel_lock_circuit_state{sel()})",
                           "state {{instance}} {{db_client_connection_pool_name}}"),
                    target(f"sum by (instance) ({born(f'otel_lock_circuit_opened_total{sel()}')})",
                           "opened {{instance}}", "B")]),
    ]


def overview() -> dict:
    lost_red = [color("lock_renewal_outcome", "lost", "red"), color("lock_renewal_outcome", "error", "orange")]
    panels = [
        row("Locks"),
        stat("Acquisitions/s", "Lock acquisitions per second over all locks and replicas.",
             [target(f"sum(rate({WAIT}_count{sel(ACQUIRED)}{RATE}))")], "reqps",
             red_above=1e12),
        stat("Timeouts/s", "Callers that gave up after their wait (HTTP 409 + Retry-After). A try_lock miss "
             "(busy) is not a timeout and is not counted.",
             [target(f"sum({born(f'{WAIT}_count{sel(TIMEOUT)}')}) / ($__rate_interval_ms / 1000) or vector(0)")],
             "reqps",
             red_above=0.01),
        stat("Leases lost", "Leases lost in the selected range, counted as OtelLockLeaseLost counts them: "
             "by the watchdog or at release (lost or expired), once per loss, including a replica's very "
             "first loss. Must be 0.",
             [target(leases_lost())], red_above=0.5),
        stat("Waiting now", "Callers queued for any lock, all replicas.",
             [target(f"sum(otel_lock_pending{sel()}) or vector(0)")], red_above=20),
        held_now(),
        timeseries("Held for / lease, by lock and replica",
                   "Age of each lock name's oldest current hold over its lease. At 1 a fixed lease runs out; "
                   "the alert warns above 0.8.",
                   [target(f"max by (lock_name, instance) (otel_lock_hold_age_seconds{sel()} "
                           f"/ otel_lock_lease_seconds{sel()})", "{{lock_name}} {{instance}}")],
                   "percentunit", links=True,
                   thresholds=[{"color": "transparent", "value": None}, {"color": "orange", "value": 0.8},
                               {"color": "red", "value": 1}]),
        timeseries("Acquisitions/s by lock and outcome",
                   "Every attempt, by lock name and outcome (acquired, busy = a try_lock miss, grey, not an "
                   "error; timeout, error, cancelled).",
                   [target(events_per_second("lock_name, lock_outcome", f"{WAIT}_count{sel()}"),
                           "{{lock_name}} {{lock_outcome}}")],
                   "reqps", links=True, overrides=outcome_colors()),
        timeseries("Contention ratio",
                   "Share of waiting acquisitions (busy excluded) that found the lock held and had to wait.",
                   [target(f"sum by (lock_name) (rate({WAIT}_count{sel(CONTENDED, NOT_BUSY)}{RATE}))"
                           f" / sum by (lock_name) (rate({WAIT}_count{sel(NOT_BUSY)}{RATE}))", "{{lock_name}}")],
                   "percentunit", links=True),
        timeseries("Wait p50 / p95 / p99 by lock",
                   "Time from asking for a lock to getting it or giving up (histogram_quantile; busy excluded).",
                   quantiles(WAIT, "lock_name, ", sel(NOT_BUSY), exemplar=True), "s", links=True),
        heatmap("Wait time heatmap (exemplars link to traces)",
                "Distribution of waits over time. Exemplar dots carry trace ids: click one to open "
                "the slow request, whose acquire span links to the holder that made it wait.",
                f"sum by (le) (increase({WAIT}_bucket{sel(NOT_BUSY)}{RATE}))"),
        timeseries("Timeouts by lock", "Acquisitions that gave up after their wait.",
                   [target(events_per_second("lock_name", f"{WAIT}_count{sel(TIMEOUT)}"),
                           "{{lock_name}}")], "reqps", links=True),
        timeseries("Errors by operation and error.type",
                   "Failed Redis round trips of acquire, release and renew (redis_unavailable, redis_error), and "
                   "waits refused as deadlocks (error.type=deadlock, drawn alone in Deadlocks by lock).",
                   [target(events_per_second("lock_operation, error_type", f"otel_lock_errors_total{sel()}"),
                           "{{lock_operation}} {{error_type}}")], "reqps"),
        timeseries("Deadlocks by lock",
                   "Waiters refused with LockDeadlock (409 lock-deadlock): their wait would have closed a cycle of "
                   "holders waiting on each other, so two code paths take the same keys in opposite orders. "
                   "Any refusal pages (OtelLockDeadlocks); the acquire span's event names the cycle.",
                   [target(events_per_second("lock_name", f"otel_lock_errors_total{sel(DEADLOCK)}"),
                           "{{lock_name}}")], "ops", links=True),
        timeseries("Permits in use vs limit",
                   "Semaphores (semaphore(permits=N), @limited): permits held now, summed over replicas, beside "
                   "the limit. At the limit with callers waiting for 5 minutes pages (OtelLockPermitsSaturated).",
                   permits(sel()), links=True),
        timeseries("Wait p95 by lock and lock.mode",
                   "Wait p95 of each lock name by lock.mode: exclusive, shared (lock(shared=True)), permit "
                   "(semaphore). Shared waiters queue behind an exclusive holder or a waiting writer.",
                   by_mode(WAIT, "lock_name, ", sel(NOT_BUSY)), "s", links=True),
        timeseries("Active locks", "Locks held right now (expired holds not counted), summed over replicas.",
                   [target(f"sum by (lock_name) (otel_lock_active{sel()})", "{{lock_name}}")], links=True),
        timeseries("Pending (waiting callers)", "Callers queued for a lock right now, summed over replicas.",
                   [target(f"sum by (lock_name) (otel_lock_pending{sel()})", "{{lock_name}}")], links=True),
        timeseries("Hold p95 / p99 beside the lease",
                   f"How long finished holds lasted. The red band is the default lease ({DEFAULT_LEASE} s); "
                   "current holds are in Held now.",
                   quantiles(HOLD, "lock_name, ", qs=(0.95, 0.99)), "s", links=True,
                   thresholds=[{"color": "transparent", "value": None},
                               {"color": "orange", "value": DEFAULT_LEASE * 0.8},
                               {"color": "red", "value": DEFAULT_LEASE}]),
        timeseries("Hold p95 by lock and lock.mode",
                   "Hold p95 of each lock name by lock.mode (exclusive, shared, permit): shared holds may overlap, "
                   "and a long one keeps writers waiting.",
                   by_mode(HOLD, "lock_name, ", sel()), "s", links=True),
        timeseries("Releases by outcome", "How holds ended: released, expired (fixed lease ran out), lost, error.",
                   [target(events_per_second("lock_name, lock_release_outcome", f"{HOLD}_count{sel()}"),
                           "{{lock_name}} {{lock_release_outcome}}")], "ops",
                   overrides=[color("lock_release_outcome", "lost", "red"),
                              color("lock_release_outcome", "expired", "orange")]),
        timeseries("Renewals by outcome (lost in red)",
                   "Watchdog lease renewals: ok, error (Redis failed, retried), lost (another owner or "
                   "no confirmation within the lease).",
                   [target(events_per_second("lock_renewal_outcome", f"otel_lock_renewals_total{sel()}"),
                           "{{lock_renewal_outcome}}")], "ops", overrides=lost_red),
        *redis_row(),
        row("Idempotency"),
        timeseries("Idempotency-Key outcomes by route",
                   "stored (first request), replayed (retry answered from the store), conflict (409, in "
                   "flight), mismatch (422, key reused with another body), missing_key / invalid_key (400).",
                   [target(events_per_second("http_route, idempotency_outcome",
                                             f"otel_lock_idempotency_requests_total{sel()}"),
                           "{{http_route}} {{idempotency_outcome}}")], "reqps", stack=True,
                   overrides=[color("idempotency_outcome", "conflict", "orange"),
                              color("idempotency_outcome", "mismatch", "red")]),
        row("HTTP"),
        timeseries("Requests/s by route", "HTTP requests by route template and method (OpenTelemetry ASGI).",
                   [target(f"sum by (http_target, http_method) (rate(http_server_duration_milliseconds_count"
                           f"{sel()}{RATE}))", "{{http_method}} {{http_target}}")], "reqps"),
        timeseries("Error responses by route and status",
                   "4xx and 5xx answers: 409 lock-timeout or out-of-stock, 400/422 idempotency, 503 Redis.",
                   [target(events_per_second("http_target, http_status_code",
                                             f"http_server_duration_milliseconds_count{sel(HTTP_ERRORS)}"),
                           "{{http_status_code}} {{http_target}}")], "reqps"),
        timeseries("Request duration p95 by route", "Server-side latency including the lock wait.",
                   [target(f"histogram_quantile(0.95, sum by (http_target, le) "
                           f"(rate(http_server_duration_milliseconds_bucket{sel()}{RATE})))", "{{http_target}}")],
                   "ms"),
        timeseries("Requests in flight by replica",
                   "HTTP requests being served right now (http.server.active_requests), summed over each "
                   "replica's worker processes. A line that climbs while requests/s stays flat: requests "
                   "pile up, e.g. queued behind a lock (compare Waiting now).",
                   [target(f"sum by (instance) (http_server_active_requests{sel()})", "{{instance}}")]),
    ]
    return dashboard("otel-lock-overview", "otel-lock: lock overview",
                     "Acquisitions, contention, wait and hold time, holds right now, Redis, idempotency and HTTP "
                     "for every lock. Alerts link here; the service and replica variables narrow every panel.",
                     panels, variables())


# -- one lock -----------------------------------------------------------------


def one_lock() -> dict:
    name = 'lock_name="$lock_name"'
    one = sel(name)
    panels = [
        row("$lock_name"),
        stat("Acquisitions/s", "Successful acquisitions of this lock per second.",
             [target(f"sum(rate({WAIT}_count{sel(name, ACQUIRED)}{RATE}))")],
             "reqps", red_above=1e12),
        stat("Contention", "Share of waiting acquisitions (busy excluded) that had to wait.",
             [target(f"sum(rate({WAIT}_count{sel(name, CONTENDED, NOT_BUSY)}{RATE}))"
                     f" / sum(rate({WAIT}_count{sel(name, NOT_BUSY)}{RATE}))")], "percentunit", red_above=0.5),
        stat("Wait p95", "95th percentile wait for this lock (busy excluded).",
             [target(f"histogram_quantile(0.95, sum by (le) (rate({WAIT}_bucket{sel(name, NOT_BUSY)}{RATE})))")],
             "s", red_above=0.5),
        stat("Held for / lease (max)", "Oldest current hold of this lock over its lease, worst replica.",
             [target(f"max(otel_lock_hold_age_seconds{one} / otel_lock_lease_seconds{one}) or vector(0)")],
             "percentunit", red_above=0.8),
        timeseries("Attempts by outcome", "Acquired, busy (try_lock miss, not an error), timeout, error, "
                   "cancelled; contended or not.",
                   [target(events_per_second("lock_outcome, lock_contended", f"{WAIT}_count{one}"),
                           "contended={{lock_contended}} {{lock_outcome}}")], "reqps",
                   overrides=outcome_colors()),
        timeseries("Wait p50 / p95 / p99", "Wait time of this lock; exemplars link to traces.",
                   quantiles(WAIT, "", sel(name, NOT_BUSY), exemplar=True), "s"),
        heatmap("Wait time heatmap (exemplars link to traces)",
                "Waits of this lock over time; click an exemplar to open the waiting request's trace.",
                f"sum by (le) (increase({WAIT}_bucket{sel(name, NOT_BUSY)}{RATE}))"),
        timeseries("Hold p50 / p95 / p99 beside the lease",
                   f"Hold time of this lock; orange at 0.8 and red at the default lease ({DEFAULT_LEASE} s).",
                   quantiles(HOLD, "", one), "s",
                   thresholds=[{"color": "transparent", "value": None},
                               {"color": "orange", "value": DEFAULT_LEASE * 0.8},
                               {"color": "red", "value": DEFAULT_LEASE}]),
        timeseries("Held and waiting, by replica", "Active holds and queued callers per replica (instance).",
                   [target(f"sum by (instance) (otel_lock_active{one})", "held {{instance}}"),
                    target(f"sum by (instance) (otel_lock_pending{one})", "waiting {{instance}}", "B")]),
        timeseries("Permits in use against the limit",
                   "A semaphore's permits held now, summed over replicas, beside its limit (permits=n); "
                   "empty for a plain lock. At the limit, new callers wait.",
                   [target(f"sum(otel_lock_permits_used{one})", "in use"),
                    target(f"max(otel_lock_permits_limit{one})", "limit", "B")]),
        timeseries("Held for and lease, by replica", "Age of the oldest current hold and the lease it runs on.",
                   [target(f"max by (instance) (otel_lock_hold_age_seconds{one})", "held for {{instance}}"),
                    target(f"max by (instance) (otel_lock_lease_seconds{one})", "lease {{instance}}", "B")], "s"),
        timeseries("Releases by outcome", "released, expired, lost, error.",
                   [target(events_per_second("lock_release_outcome", f"{HOLD}_count{one}"),
                           "{{lock_release_outcome}}")], "ops",
                   overrides=[color("lock_release_outcome", "lost", "red"),
                              color("lock_release_outcome", "expired", "orange")]),
        timeseries("Renewals by outcome (lost in red)", "Watchdog renewals of this lock.",
                   [target(events_per_second("lock_renewal_outcome", f"otel_lock_renewals_total{one}"),
                           "{{lock_renewal_outcome}}")], "ops",
                   overrides=[color("lock_renewal_outcome", "lost", "red"),
                              color("lock_renewal_outcome", "error", "orange")]),
        timeseries("Errors by operation and error.type", "Redis failures on acquire, release, renew; refused deadlocks.",
                   [target(events_per_second("lock_operation, error_type", f"otel_lock_errors_total{one}"),
                           "{{lock_operation}} {{error_type}}")], "reqps"),
        timeseries("Deadlocks refused", "Waiters for this lock refused with LockDeadlock (409 lock-deadlock).",
                   [target(events_per_second("instance", f"otel_lock_errors_total{sel(name, DEADLOCK)}"),
                           "{{instance}}")], "ops"),
        timeseries("Wait and hold p95 by lock.mode",
                   "This lock's wait and hold p95 by lock.mode (exclusive, shared, permit).",
                   [{**by_mode(WAIT, "", sel(name, NOT_BUSY))[0], "legendFormat": "wait {{lock_mode}}"},
                    {**by_mode(HOLD, "", one)[0], "legendFormat": "hold {{lock_mode}}", "refId": "B"}], "s"),
        *redis_row(name)[:2],
    ]
    return dashboard("otel-lock-lock", "otel-lock: one lock",
                     "Drill-down into one lock name: choose it in the `lock` variable.", panels,
                     variables(lock_name=True))


DASHBOARDS = {"otel-lock-overview.json": overview, "otel-lock-lock.json": one_lock}


def render(build) -> str:
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for filename, build in DASHBOARDS.items():
        path = HERE / filename
        text = render(build)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(filename)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run python dashboards/generate.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
