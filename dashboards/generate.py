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
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # fixed in deploy/grafana/provisioning
DEFAULT_LEASE = 30  # seconds: drawn beside hold time
RATE = "[$__rate_interval]"
DRILL_DOWN = "/d/otel-lock-lock/otel-lock-lock?var-lock_name=${__field.labels.lock_name}&${__url_time_range}"

WAIT = "otel_lock_wait_duration_seconds"
HOLD = "otel_lock_hold_duration_seconds"


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


def quantiles(metric: str, by: str, selector: str = "", qs=(0.5, 0.95, 0.99), exemplar: bool = False) -> list[dict]:
    return [
        target(f"histogram_quantile({q}, sum by ({by}le) (rate({metric}_bucket{selector}{RATE})))",
               f"p{int(q * 100)}" + (" {{lock_name}}" if "lock_name" in by else ""), chr(ord("A") + i),
               exemplar=exemplar)
        for i, q in enumerate(qs)
    ]


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


def dashboard(uid: str, title: str, description: str, panels: list[dict], variables: list[dict] = ()) -> dict:
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


def overview() -> dict:
    lost_red = [color("lock_renewal_outcome", "lost", "red"), color("lock_renewal_outcome", "error", "orange")]
    panels = [
        row("Locks"),
        stat("Acquisitions/s", "Lock acquisitions per second over all locks and replicas.",
             [target(f"sum(rate({WAIT}_count{{lock_outcome=\"acquired\"}}{RATE}))")], "reqps", red_above=1e12),
        stat("Timeouts/s", "Callers that gave up after their wait (HTTP 409 + Retry-After).",
             [target(f"sum(rate({WAIT}_count{{lock_outcome=\"timeout\"}}{RATE})) or vector(0)")], "reqps",
             red_above=0.01),
        stat("Leases lost", "Holders that lost their lease in the selected range. Must be 0.",
             [target("sum(increase(otel_lock_renewals_total{lock_renewal_outcome=\"lost\"}[$__range])) or vector(0)")],
             red_above=0.5),
        stat("Waiting now", "Callers queued for any lock, all replicas.",
             [target("sum(otel_lock_pending)")], red_above=20),
        timeseries("Acquisitions/s by lock and outcome",
                   "Every attempt, by lock name and outcome (acquired, timeout, error, cancelled).",
                   [target(f"sum by (lock_name, lock_outcome) (rate({WAIT}_count{RATE}))",
                           "{{lock_name}} {{lock_outcome}}")],
                   "reqps", links=True,
                   overrides=[color("lock_outcome", "timeout", "orange"), color("lock_outcome", "error", "red")]),
        timeseries("Contention ratio",
                   "Share of acquisitions that found the lock held and had to wait.",
                   [target(f"sum by (lock_name) (rate({WAIT}_count{{lock_contended=\"true\"}}{RATE}))"
                           f" / sum by (lock_name) (rate({WAIT}_count{RATE}))", "{{lock_name}}")],
                   "percentunit", links=True),
        timeseries("Wait p50 / p95 / p99 by lock",
                   "Time from asking for a lock to getting it or giving up (histogram_quantile).",
                   quantiles(WAIT, "lock_name, ", exemplar=True), "s", links=True),
        heatmap("Wait time heatmap (exemplars link to traces)",
                "Distribution of waits over time. Exemplar dots carry trace ids: click one to open "
                "the slow request, whose acquire span links to the holder that made it wait.",
                f"sum by (le) (increase({WAIT}_bucket{RATE}))"),
        timeseries("Timeouts by lock", "Acquisitions that gave up after their wait.",
                   [target(f"sum by (lock_name) (rate({WAIT}_count{{lock_outcome=\"timeout\"}}{RATE}))",
                           "{{lock_name}}")], "reqps", links=True),
        timeseries("Errors by operation and error.type",
                   "Failed Redis round trips of acquire, release and renew (redis_unavailable, redis_error).",
                   [target("sum by (lock_operation, error_type) (rate(otel_lock_errors_total" + RATE + "))",
                           "{{lock_operation}} {{error_type}}")], "reqps"),
        timeseries("Active locks", "Locks held right now, summed over replicas.",
                   [target("sum by (lock_name) (otel_lock_active)", "{{lock_name}}")], links=True),
        timeseries("Pending (waiting callers)", "Callers queued for a lock right now, summed over replicas.",
                   [target("sum by (lock_name) (otel_lock_pending)", "{{lock_name}}")], links=True),
        timeseries("Hold p95 / p99 beside the lease",
                   f"How long locks are held. The red band is the default lease ({DEFAULT_LEASE} s): a fixed "
                   "lease shorter than the hold expires under the holder; watchdog-renewed holds this long "
                   "mean slow work inside the lock.",
                   quantiles(HOLD, "lock_name, ", qs=(0.95, 0.99)), "s", links=True,
                   thresholds=[{"color": "transparent", "value": None},
                               {"color": "orange", "value": DEFAULT_LEASE * 2 / 3},
                               {"color": "red", "value": DEFAULT_LEASE}]),
        timeseries("Releases by outcome", "How holds ended: released, expired (fixed lease ran out), lost, error.",
                   [target(f"sum by (lock_name, lock_release_outcome) (rate({HOLD}_count{RATE}))",
                           "{{lock_name}} {{lock_release_outcome}}")], "ops",
                   overrides=[color("lock_release_outcome", "lost", "red"),
                              color("lock_release_outcome", "expired", "orange")]),
        timeseries("Renewals by outcome (lost in red)",
                   "Watchdog lease renewals: ok, error (Redis failed, retried), lost (another owner or "
                   "no confirmation within the lease).",
                   [target("sum by (lock_renewal_outcome) (rate(otel_lock_renewals_total" + RATE + "))",
                           "{{lock_renewal_outcome}}")], "ops", overrides=lost_red),
        row("Idempotency"),
        timeseries("Idempotency-Key outcomes by route",
                   "stored (first request), replayed (retry answered from the store), conflict (409, in "
                   "flight), mismatch (422, key reused with another body), missing_key / invalid_key (400).",
                   [target("sum by (http_route, idempotency_outcome) "
                           "(rate(otel_lock_idempotency_requests_total" + RATE + "))",
                           "{{http_route}} {{idempotency_outcome}}")], "reqps", stack=True,
                   overrides=[color("idempotency_outcome", "conflict", "orange"),
                              color("idempotency_outcome", "mismatch", "red")]),
        row("HTTP"),
        timeseries("Requests/s by route", "HTTP requests by route template and method (OpenTelemetry ASGI).",
                   [target("sum by (http_target, http_method) (rate(http_server_duration_milliseconds_count"
                           + RATE + "))", "{{http_method}} {{http_target}}")], "reqps"),
        timeseries("Error responses by route and status",
                   "4xx and 5xx answers: 409 lock-timeout or out-of-stock, 400/422 idempotency, 503 Redis.",
                   [target("sum by (http_target, http_status_code) (rate(http_server_duration_milliseconds_count"
                           "{http_status_code=~\"[45]..\"}" + RATE + "))",
                           "{{http_status_code}} {{http_target}}")], "reqps"),
        timeseries("Request duration p95 by route", "Server-side latency including the lock wait.",
                   [target("histogram_quantile(0.95, sum by (http_target, le) "
                           "(rate(http_server_duration_milliseconds_bucket" + RATE + ")))", "{{http_target}}")],
                   "ms"),
    ]
    return dashboard("otel-lock-overview", "otel-lock: lock overview",
                     "Acquisitions, contention, wait and hold time, renewals, idempotency and HTTP for every lock.",
                     panels)


# -- one lock -----------------------------------------------------------------


def one_lock() -> dict:
    sel = '{lock_name="$lock_name"}'
    variable = {
        "name": "lock_name", "label": "lock", "type": "query", "datasource": DATASOURCE,
        "query": {"query": f"label_values({WAIT}_count, lock_name)", "refId": "lock_name"},
        "definition": f"label_values({WAIT}_count, lock_name)",
        "refresh": 2, "sort": 1, "multi": False, "includeAll": False, "current": {},
    }
    panels = [
        row("$lock_name"),
        stat("Acquisitions/s", "Successful acquisitions of this lock per second.",
             [target(f"sum(rate({WAIT}_count{{lock_name=\"$lock_name\",lock_outcome=\"acquired\"}}{RATE}))")],
             "reqps", red_above=1e12),
        stat("Contention", "Share of acquisitions that had to wait.",
             [target(f"sum(rate({WAIT}_count{{lock_name=\"$lock_name\",lock_contended=\"true\"}}{RATE}))"
                     f" / sum(rate({WAIT}_count{sel}{RATE}))")], "percentunit", red_above=0.5),
        stat("Wait p95", "95th percentile wait for this lock.",
             [target(f"histogram_quantile(0.95, sum by (le) (rate({WAIT}_bucket{sel}{RATE})))")], "s",
             red_above=0.5),
        stat("Hold p99", f"99th percentile hold time (default lease {DEFAULT_LEASE} s).",
             [target(f"histogram_quantile(0.99, sum by (le) (rate({HOLD}_bucket{sel}{RATE})))")], "s",
             red_above=DEFAULT_LEASE * 2 / 3),
        timeseries("Attempts by outcome", "Acquired, timeout, error, cancelled; contended or not.",
                   [target(f"sum by (lock_outcome, lock_contended) (rate({WAIT}_count{sel}{RATE}))",
                           "contended={{lock_contended}} {{lock_outcome}}")], "reqps",
                   overrides=[color("lock_outcome", "timeout", "orange"), color("lock_outcome", "error", "red")]),
        timeseries("Wait p50 / p95 / p99", "Wait time of this lock; exemplars link to traces.",
                   quantiles(WAIT, "", sel, exemplar=True), "s"),
        heatmap("Wait time heatmap (exemplars link to traces)",
                "Waits of this lock over time; click an exemplar to open the waiting request's trace.",
                f"sum by (le) (increase({WAIT}_bucket{sel}{RATE}))"),
        timeseries("Hold p50 / p95 / p99 beside the lease",
                   f"Hold time of this lock; orange at 2/3 and red at the default lease ({DEFAULT_LEASE} s).",
                   quantiles(HOLD, "", sel), "s",
                   thresholds=[{"color": "transparent", "value": None},
                               {"color": "orange", "value": DEFAULT_LEASE * 2 / 3},
                               {"color": "red", "value": DEFAULT_LEASE}]),
        timeseries("Held and waiting, by replica", "Active holds and queued callers per replica (instance).",
                   [target(f"sum by (instance) (otel_lock_active{sel})", "held {{instance}}"),
                    target(f"sum by (instance) (otel_lock_pending{sel})", "waiting {{instance}}", "B")]),
        timeseries("Releases by outcome", "released, expired, lost, error.",
                   [target(f"sum by (lock_release_outcome) (rate({HOLD}_count{sel}{RATE}))",
                           "{{lock_release_outcome}}")], "ops",
                   overrides=[color("lock_release_outcome", "lost", "red"),
                              color("lock_release_outcome", "expired", "orange")]),
        timeseries("Renewals by outcome (lost in red)", "Watchdog renewals of this lock.",
                   [target(f"sum by (lock_renewal_outcome) (rate(otel_lock_renewals_total{sel}{RATE}))",
                           "{{lock_renewal_outcome}}")], "ops",
                   overrides=[color("lock_renewal_outcome", "lost", "red"),
                              color("lock_renewal_outcome", "error", "orange")]),
        timeseries("Errors by operation and error.type", "Redis failures on acquire, release, renew.",
                   [target(f"sum by (lock_operation, error_type) (rate(otel_lock_errors_total{sel}{RATE}))",
                           "{{lock_operation}} {{error_type}}")], "reqps"),
    ]
    return dashboard("otel-lock-lock", "otel-lock: one lock",
                     "Drill-down into one lock name: choose it in the `lock` variable.", panels, [variable])


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
