"""The benchmark harness's own arithmetic: handoffs, overlaps, fairness, tick bursts, best rounds, docs splice.

The benchmarks measure; these tests only check that what they compute from
the records is right, so a table can be trusted. No Redis, no timing.
"""

from __future__ import annotations

from benchmarks._counting import bursts
from benchmarks._report import update_docs
from benchmarks.bench_lock import analyse
from benchmarks.run import best_rounds


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
