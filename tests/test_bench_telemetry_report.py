"""The telemetry benchmark's report: targets per mode, the per-part split, and no verdicts on --quick."""

from __future__ import annotations

import pytest

from benchmarks._otel_modes import ENDPOINT_MODES, MODES, TARGETS, env_for
from benchmarks._report import TELEMETRY_TARGETS, render


def data(quick: bool) -> dict:
    cycle = [{"mode": m, "cycles_per_s": 1000, "p50_ms": p, "p99_ms": 1, "client_cpu_per_cycle_us": c,
              "rounds": [p]} for m, p, c in (("off", 0.200, 100), ("prom", 0.210, 105), ("otlp", 0.260, 130))]
    endpoint = [{"mode": m, "case": "c=1", "rps": 100, "p50_ms": p, "p99_ms": 2, "statuses": {"200": 10},
                 "rounds": [p]}
                for m, p in (("off", 1.0), ("prom-lock", 1.05), ("prom", 1.25), ("otlp-lock", 1.1), ("otlp", 1.6))]
    machine = {"date": "now", "quick": quick, "nproc": 2, "python": "3", "redis": "7", "platform": "x",
               "seconds": 1}
    return {"cycle": cycle, "endpoint": endpoint, "machine": machine}


def test_targets_are_10_percent_with_metrics_and_25_with_otlp():
    assert TARGETS == TELEMETRY_TARGETS == {"prom": 0.10, "otlp": 0.25}
    found: list = []
    text = render("telemetry", data(quick=False), found)
    verdicts = {target: ok for target, _, ok in found}
    assert verdicts == {
        "lock cycle p50 overhead <= 10% (/metrics (prometheus-client fast path))": True,
        "lock cycle client CPU overhead <= 10% (/metrics (prometheus-client fast path))": True,
        "lock cycle p50 overhead <= 25% (OTLP/HTTP (fast path, one export))": False,   # +30%
        "lock cycle client CPU overhead <= 25% (OTLP/HTTP (fast path, one export))": False,
    }
    assert "**missed**" in text and "**met**" in text


def test_endpoint_overhead_is_split_into_the_lock_part_and_the_asgi_part():
    text = render("telemetry", data(quick=False))
    assert "| /metrics (prometheus-client fast path) | c=1 | +5.0% | +20.0% | +25.0% |" in text
    assert "| OTLP/HTTP (fast path, one export) | c=1 | +10.0% | +50.0% | +60.0% |" in text


def test_quick_runs_print_no_verdict():
    found: list = []
    text = render("telemetry", data(quick=True), found)
    assert "**met**" not in text and "**missed**" not in text and not found


def test_every_mode_has_an_environment_and_otlp_runs_one_reader():
    assert set(MODES) <= set(ENDPOINT_MODES)
    assert env_for("prom", 1) == {} and env_for("off", 1) == {}
    assert env_for("otlp-lock", 4318)["OTEL_METRICS_EXPORTER"] == "otlp"


def test_a_short_run_says_so_keeps_its_verdicts_and_shows_the_worker_process_row():
    short = data(quick=False)
    short["plan"] = "short"
    short["cycle"].append({"mode": "prom-workers", "cycles_per_s": 900, "p50_ms": 0.23, "p99_ms": 1,
                           "client_cpu_per_cycle_us": 115, "rounds": [0.23]})
    found: list = []
    text = render("telemetry", short, found)
    assert "A shortened run (`--short`" in text and found
    assert "| /metrics, worker-process mode (PROMETHEUS_MULTIPROC_DIR) | 900 | 0.230 |" in text


@pytest.mark.parametrize("argv", [["--short"], ["--short", "--only", "lock"],
                                  ["--short", "--quick", "--only", "telemetry"]])
def test_short_is_only_for_the_telemetry_suite_and_never_quick(argv, capsys):
    from benchmarks.run import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2
    assert "--short is for --only telemetry" in capsys.readouterr().err
