"""The safety checker on the shapes beyond the mutex: its arithmetic on hand-made holds, then real runs.

lock_all (2-3 of four keys named in a random order), shared beside exclusive
holds of one key, and permits: an exclusive hold overlaps nobody on its key,
shared holds may overlap each other, permit holders never pass the limit and
reach it, and the tokens of a key only grow in grant order. Each real run
has a control that must fail: `otel-lock-loose`, otel-lock with each shape
weakened on purpose (an exclusive request taken shared, one permit more than
the limit judged by, only the first of lock_all's keys taken). A checker that
cannot fail proves nothing.
"""

from __future__ import annotations

import pytest

from benchmarks.safety import PERMITS
from benchmarks.safety._overlaps import Hold, over_limit, overlaps, peak_holders, shared_together, summarise, \
    token_regressions
from benchmarks.safety._run import holds_of, shape_keys

from _safety_run import run_checker


def hold(proc, start, end, token=None, mode="exclusive", key="k", **kw) -> Hold:
    return Hold(proc, 0, start, end, token, key=key, mode=mode, **kw)


# -- arithmetic ------------------------------------------------------------------


def test_shared_holds_may_overlap_each_other_but_not_an_exclusive_one():
    readers = [hold(1, 0.0, 2.0, 1, "shared"), hold(2, 0.5, 1.5, 2, "shared")]
    assert overlaps(readers) == []
    assert shared_together(readers) == 1
    (o,) = overlaps(readers + [hold(3, 1.0, 3.0, 3)])[:1]
    assert o.newer.proc == 3 and o.newer.mode == "exclusive"
    assert len(overlaps(readers + [hold(3, 1.0, 3.0, 3)])) == 2  # the writer overlaps both readers


def test_permits_are_counted_against_the_limit_not_as_overlaps():
    three = [hold(1, 0.0, 3.0, 1, "permit"), hold(2, 1.0, 2.5, 2, "permit"), hold(3, 2.0, 4.0, 3, "permit")]
    assert overlaps(three) == []
    assert peak_holders(three) == 3
    assert over_limit(three, 3) == 0
    assert over_limit(three, 2) == 1  # the third began while two held
    s = summarise(three, permits=2)
    assert (s["permit_peak"], s["permit_over"], s["overlaps"]) == (3, 1, 0)


def test_a_holder_told_its_lease_was_lost_is_not_counted_against_the_limit():
    # SIGSTOPped past its lease: Redis let another in; the stale holder learnt it (lost) when it ran again
    stale = hold(1, 0.0, 3.0, 1, "permit", lost_at=2.5)
    newer = [hold(2, 1.0, 2.0, 2, "permit"), hold(3, 1.5, 2.5, 3, "permit")]
    assert over_limit([stale, *newer], 2) == 1
    assert over_limit([stale, *newer], 2, stale_count=False) == 0
    assert summarise([stale, *newer], permits=2)["permit_over_untold"] == 0


def test_touching_permits_are_not_together_and_keys_are_counted_apart():
    assert peak_holders([hold(1, 0.0, 1.0, 1, "permit"), hold(2, 1.0, 2.0, 2, "permit")]) == 1
    apart = [hold(1, 0.0, 2.0, 1, "permit", key="a"), hold(2, 0.5, 2.0, 1, "permit", key="b")]
    assert (peak_holders(apart), over_limit(apart, 1)) == (1, 0)


def test_a_permit_and_a_shared_hold_never_share_with_an_exclusive_or_each_other():
    assert len(overlaps([hold(1, 0.0, 2.0, 1, "permit"), hold(2, 1.0, 3.0, 2, "shared")])) == 1


def test_tokens_of_a_key_grow_in_grant_order_across_modes():
    fine = [hold(1, 0.0, 1.0, 1, "shared"), hold(2, 0.5, 1.5, 2, "shared"), hold(3, 2.0, 3.0, 3),
            hold(1, 3.5, 4.0, 4, "shared")]
    assert token_regressions(fine) == 0
    # an exclusive hold after a reader ended, with a smaller token: granted before the reader let go
    assert token_regressions(fine + [hold(4, 1.6, 1.9, 2)]) == 1


def test_a_shared_reply_read_late_is_no_regression_but_a_later_request_is():
    # granted first (token 5) while another reader held, its reply read after that reader left
    late = [hold(1, 0.0, 1.0, 6, "shared", requested=0.0), hold(2, 1.2, 2.0, 5, "shared", requested=0.5)]
    assert token_regressions(late) == 0
    asked_after = [hold(1, 0.0, 1.0, 6, "shared", requested=0.0), hold(2, 1.2, 2.0, 5, "shared", requested=1.1)]
    assert token_regressions(asked_after) == 1


def test_a_lock_all_event_is_one_hold_per_key_with_its_own_token():
    event = {"task": 2, "key": "a", "req": 0.5, "start": 1.0, "token": None,
             "parts": [["a", 7, "exclusive"], ["c", 3, "exclusive"]]}
    held = holds_of(4, event, 2.0, release=True)
    assert [(h.key, h.token, h.start, h.end, h.requested, h.proc, h.task) for h in held] == [
        ("a", 7, 1.0, 2.0, None, 4, 2), ("c", 3, 1.0, 2.0, None, 4, 2)]  # no key's own wait is known
    plain = holds_of(1, {"task": 0, "key": "safety", "req": 0.0, "start": 0.1, "token": 9}, 0.2)
    assert [(h.key, h.token, h.mode, h.requested) for h in plain] == [("safety", 9, "exclusive", 0.0)]


def test_lock_all_runs_over_a_small_key_set_of_their_own():
    assert shape_keys("lock_all", ["safety"]) == ["safety-0", "safety-1", "safety-2", "safety-3"]
    assert shape_keys("rw", ["safety"]) == ["safety"]


# -- real runs: the shapes and their loosened controls, fault "none" --------------


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict:
    """One checker run of every shape for otel-lock and its loosened control: {(library, shape): row}."""
    code, rows = run_checker(tmp_path_factory.mktemp("safety-shapes") / "shapes.json", "--shape",
                             "lock_all,rw,permits", "--libs", "otel-lock,otel-lock-loose", "--faults", "none")
    assert code == 0, "the checker failed otel-lock's own rows"
    return {(r["library"], r["shape"]): r for r in rows}


def row_of(shapes: dict, lib: str, shape: str) -> dict:
    assert (lib, shape) in shapes, f"the run has no row for {lib} {shape}"
    r = shapes[lib, shape]
    assert r["holds"] > 0 and r["hung"] == 0, f"{lib} {shape}: {r['holds']} holds, {r['hung']} hung"
    return r


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", ["lock_all", "rw", "permits"])
def test_the_shapes_never_overlap_where_they_may_not_and_tokens_only_grow(shapes, shape):
    r = row_of(shapes, "otel-lock", shape)
    assert r["overlaps"] == 0, f"{shape}: {r['overlaps']} overlaps (longest {r['max_overlap_ms']} ms)"
    assert r["token_regressions"] == 0, f"{shape}: tokens went backwards {r['token_regressions']} times"
    assert r["misses"] == "none"
    if shape == "rw":
        assert r["shared_together"] > 0, "no two shared holds ever overlapped: readers were not let in together"
    if shape == "permits":
        assert (r["permit_peak"], r["permit_over"], r["permit_over_untold"]) == (PERMITS, 0, 0), r["permits_seen"]


@pytest.mark.timeout(300)
def test_the_checker_finds_a_loosened_lock_all_and_shared_lock(shapes):
    taken_one = row_of(shapes, "otel-lock-loose", "lock_all")
    assert taken_one["unsafe"] > 0 and "unsafe" in taken_one["misses"]
    exclusive_as_shared = row_of(shapes, "otel-lock-loose", "rw")
    assert exclusive_as_shared["overlaps"] > 0 and "overlap" in exclusive_as_shared["misses"]


@pytest.mark.timeout(300)
def test_the_checker_finds_one_permit_too_many(shapes):
    r = row_of(shapes, "otel-lock-loose", "permits")
    assert r["permit_peak"] == PERMITS + 1 and r["permit_over_untold"] > 0
    assert "permits" in r["misses"]
