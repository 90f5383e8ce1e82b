"""The benchmark harness's own arithmetic: handoffs, overlaps, fairness, tick bursts, best rounds, docs splice.

The benchmarks measure; these tests only check that what they compute from
the records is right, so a table can be trusted, and (one smoke test on real
servers) that the deployments and shapes benchmarks run every row. No timing.
"""

from __future__ import annotations

import math

from benchmarks import bench_deployments, bench_shapes
from benchmarks._adapters import available
from benchmarks._counting import bursts
from benchmarks._report import render, update_docs
from benchmarks.bench_lock import analyse
from benchmarks.run import best_rounds, machine


def test_handoffs_count_only_changes_of_holder():
    # (worker, requested, entered, left)
    records = [(1, 0.0, 0.0, 0.1), (1, 0.1, 0.1, 0.2), (2, 0.0, 0.2, 0.3), (1, 0.2, 0.3, 0.4)]
    row = analyse(records, window=1.0)
    assert row["acquisitions"] == 4
    assert row["handoffs"] == 2
    assert row["overlaps"] == 0
    assert row["busiest_share"] == 0.75
    assert row["workers_served"] == 2


def test_overlapping_holds_are_counted_whatever_order_records_arrive_in():
    records = [(2, 0.0, 0.25, 0.3), (1, 0.0, 0.0, 0.3), (3, 0.0, 0.5, 0.6)]
    assert analyse(records, window=1.0)["overlaps"] == 1


def test_a_hold_nested_in_a_long_one_overlaps_even_after_a_short_one():
    # 1 holds 0-1.0; 2 enters at 0.5 (overlap); 3 enters at 0.8: still inside 1's hold
    records = [(1, 0, 0.0, 1.0), (2, 0, 0.5, 0.6), (3, 0, 0.8, 0.9)]
    assert analyse(records, window=1.0)["overlaps"] == 2


def test_handoffs_and_overlaps_are_counted_per_key():
    # (worker, requested, entered, left, key index): two keys held at once by two workers is no overlap
    records = [(1, 0.0, 0.0, 0.2, 0), (2, 0.0, 0.1, 0.3, 1), (2, 0.2, 0.3, 0.4, 0), (1, 0.2, 0.35, 0.5, 1)]
    row = analyse(records, window=1.0)
    assert row["overlaps"] == 0
    assert row["handoffs"] == 2
    assert analyse([*records, (3, 0.0, 0.45, 0.6, 1)], window=1.0)["overlaps"] == 1


def test_waits_are_measured_from_request_to_entry():
    records = [(1, 0.0, 0.010, 0.011), (2, 0.0, 0.030, 0.031)]
    row = analyse(records, window=1.0)
    assert round(row["wait_p50_ms"]) in (10, 30)
    assert round(row["wait_p99_ms"]) == 30


def test_bursts_split_round_trips_into_ticks():
    stamps = [0.0, 0.001, 0.002, 1.0, 1.003, 2.0]
    assert [len(b) for b in bursts(stamps, gap=0.25)] == [3, 2, 1]


def test_best_round_per_library_keeps_every_round():
    rows = [{"lib": "a", "x": 1.0}, {"lib": "b", "x": 5.0}, {"lib": "a", "x": 3.0}]
    best = best_rounds(rows, "x", higher=True)
    assert [(r["lib"], r["x"], r["rounds"]) for r in best] == [("a", 3.0, [1.0, 3.0]), ("b", 5.0, [5.0])]
    assert best_rounds(rows, "x", higher=False)[0]["x"] == 1.0


def test_update_docs_replaces_only_its_own_block(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\n<!-- results:lock:start -->\nold\n<!-- results:lock:end -->\n\ntail\n")
    update_docs(doc, "lock", "new\n")
    update_docs(doc, "middleware", "mw\n")
    text = doc.read_text()
    assert "old" not in text and "new\n<!-- results:lock:end -->" in text
    assert text.index("tail") < text.index("<!-- results:middleware:start -->")


def test_deployments_benchmark_smoke_runs_every_row(redis_url):
    # the smallest size: 2 worker processes per row, 0.3 s windows; Sentinel, Cluster and 3 masters are
    # started and stopped in there
    data = bench_deployments.run(redis_url, "smoke")
    assert data["failures"] == []
    expected = [r.id for r in bench_deployments.ROWS if available(r.lib)]
    assert [r["row"] for r in data["rows"]] == expected
    assert {r["deployment"] for r in data["rows"]} == {"single", "sentinel", "cluster", "redlock"}
    assert {"sentinel", "sentinel-wait1", "cluster", "redlock"} <= set(expected)
    for row in data["rows"]:
        assert row["overlaps"] == 0, row["row"]
        for field in ("acquisitions", "handoffs", "handoffs_per_s", "redis_commands_per_handoff"):
            assert row[field] > 0, (row["row"], field)
        assert row["wait_p99_ms"] >= row["wait_p50_ms"] >= 0 and not math.isnan(row["wait_p99_ms"])
        assert row["workers_served"] == 2
    masters = {k["cluster_master_port"] for k in data["keys"]}
    assert len(masters) == 3  # the contended keys sit on every Cluster master
    data["machine"] = {**machine(), "quick": True, "seconds": 0.0, "loadavg_at_end": 0.0}
    table = render("deployments", data)
    assert table.count("\n| ") == len(expected) + 1  # header and one line per row


def test_shapes_benchmark_smoke_runs_every_row(redis_url):
    # the shapes' side-by-side run at its smallest: every uncontended row, the contended pair, one table
    data = bench_shapes.run(redis_url, "smoke", say=lambda _: None)
    assert data["failures"] == []
    assert [r["lib"] for r in data["uncontended"]] == [lib for lib in bench_shapes.UNCONTENDED if available(lib)]
    for row in data["uncontended"]:
        assert row["cycles"] > 0 and row["p50_ms"] > 0, row["lib"]
    for table in ("contended", "side_by_side"):
        assert sorted(r["hold_other"] for r in data[table]) == [False, True], table
        for row in data[table]:
            assert row["overlaps"] == 0 and row["handoffs"] > 0, (table, row)
    data["machine"] = {**machine(), "quick": False, "seconds": 0.0, "loadavg_at_end": 0.0}
    table = render("shapes", data)
    assert "deadlock check" in table and table.count("**met**") + table.count("**missed**") == 4
