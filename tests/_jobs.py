"""The jobs of ./scripts/test and which tests belong to which (CONTRIBUTING.md, "Tests").

behaviour and system run on two xdist workers (system: a file per worker,
whole programs mostly waiting on their own clocks); serial and tooling run one
test at a time. A test's job follows from its marks; the marks of whole
modules and of single tests are given here, in one place, so that no test
file needs editing to move a test between jobs. conftest.py applies them and
refuses a collection in which a test falls in no job or in two.
"""

from __future__ import annotations

from collections.abc import Iterable

from _pytest.mark.expression import Expression

# Each job is a `-m` expression; ./scripts/test passes them as they are written here
# (`python tests/_jobs.py NAME` prints one, `python tests/_jobs.py quick` the quick set).
JOBS = {
    "behaviour": "not serial and not failover and not tooling and not system",
    "serial": "(serial or failover) and not tooling and not system",
    "tooling": "tooling",
    "system": "system and not tooling",
}

# The inner loop (`./scripts/test --quick`): the lock core and the middleware, the behaviour job's part of them.
QUICK = ["tests/test_lock.py", "tests/test_middleware.py", "tests/test_idempotency.py", "tests/test_breaker.py",
         "tests/test_middleware_fastapi.py", "tests/test_routing.py"]

# mark -> "file.py" (every test of the module) or "file.py::test_function" (every parameter of one test).
MARKS: dict[str, list[str]] = {
    # Load-sensitive: several processes racing, sleeps to a computed instant, a bound a busy
    # neighbour can break (the client-kill and cancelled-round fixes, the WAIT allowances).
    "serial": [
        "test_send_budget.py::test_the_budget_is_shared_by_the_sends_of_one_response",
        "test_lock_processes.py",
        "test_lock_safety.py",
        "test_lock_shapes_processes.py",
        "test_lock_replies.py",
        "test_redlock.py",
        "test_sentinel.py",
        "test_sentinel_shapes.py",
        "test_tls.py",
        "test_data_model.py",
        "test_lock_all_topologies.py",
        "test_lock_all_stalls.py",
        "test_lock_all_processes.py",
        "test_deadlock.py::test_crossed_waits_across_processes_are_refused_at_once_with_the_cycle",
        "test_deadlock.py::test_a_chain_across_processes_is_not_refused_and_a_three_cycle_is",
        "test_deadlock.py::test_lock_all_in_opposite_orders_across_processes_never_times_out",
        "test_breaker.py::test_a_holder_whose_renewals_fail_is_told_lost_by_lease_minus_drift",
    ],
    # Checks of the tree rather than of behaviour: type checkers, the wheel, the image, the docs site.
    "tooling": [
        "test_typing.py",
        "test_middleware_typing.py",
        "test_packaging.py",
        "test_deploy_replay.py",
        "test_docs_site.py",
        "test_benchmarks.py::test_deployments_benchmark_smoke_runs_every_row",
        "test_benchmarks.py::test_shapes_benchmark_smoke_runs_every_row",
    ],
    # Whole programs: the demo, replicas, the local stack, live Prometheus, the safety checker's
    # runs; and the runs at scale (200,000 held locks listed, 20,000 keys of telemetry).
    "system": [
        "test_cli.py::test_locks_lists_200000_held_locks_in_bounded_memory",
        "test_telemetry_cardinality.py::test_twenty_thousand_keys_and_random_hosts_leave_the_series_flat",
        "test_demo_replicas.py",
        "test_telemetry_processes.py",
        "test_versions_mixed_fleet.py",
        "test_alerts_live.py",
        "test_dashboards_live.py",
        "test_cli.py::test_demo_end_to_end_starts_its_own_redis_and_passes",
        "test_cli.py::test_demo_on_an_external_cluster_or_sentinel_passes",
        "test_cli.py::test_demo_exits_1_when_the_locks_are_off",
        "test_cli.py::test_demo_ctrl_c_stops_everything_it_started",
        "test_local_stack.py::test_stack_runs_and_stops_everything_on_ctrl_c",
        "test_local_stack.py::test_the_stack_runs_its_replicas_with_keys_hashed_in_spans",
        "test_safety_checker.py::test_the_checker_sees_the_overlaps_of_no_lock_at_all",
        "test_safety_checker.py::test_every_worker_process_holds_the_lock",
        "test_safety_checker.py::test_no_overlap_is_untold_and_unfenced",
        "test_safety_checker.py::test_no_overlap_unless_a_stall_outlasts_the_lease_or_redis_forgets_the_lock",
        "test_safety_checker.py::test_stale_holders_after_a_stall_are_fenced_and_told_at_their_next_await",
        "test_safety_checker.py::test_no_waiter_outlasts_its_wait_by_more_than_a_round_trip_and_the_socket_timeout",
        "test_safety_checker.py::test_redis_commands_per_handoff_stay_flat",
        "test_safety_checker.py::test_no_overlap_is_untold_and_unfenced_on_cluster_and_sentinel",
        "test_safety_shapes.py::test_the_shapes_never_overlap_where_they_may_not_and_tokens_only_grow",
        "test_safety_shapes.py::test_the_checker_finds_a_loosened_lock_all_and_shared_lock",
        "test_safety_shapes.py::test_the_checker_finds_one_permit_too_many",
    ],
}


def marks_for(module: str, function: str) -> list[str]:
    """The job marks MARKS gives the test `function` of the file named `module`."""
    return [mark for mark, where in MARKS.items() if module in where or f"{module}::{function}" in where]


def misplaced(tests: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
    """For (test id, mark names) pairs: a line for each test in no job or in more than one."""
    wrong = []
    for test, marks in tests:
        jobs = jobs_of(marks)
        if len(jobs) != 1:
            wrong.append(f"{test}: in {', '.join(jobs) or 'no job'}")
    return wrong


def jobs_of(marks: Iterable[str]) -> list[str]:
    """The jobs whose expression a test with these mark names matches (exactly one, in a sound layout)."""
    names = set(marks)

    def matcher(name: str, /, **kwargs: object) -> bool:
        return not kwargs and name in names

    return [job for job, expression in JOBS.items() if Expression.compile(expression).evaluate(matcher)]


if __name__ == "__main__":
    import sys

    print(" ".join(QUICK) if sys.argv[1] == "quick" else JOBS[sys.argv[1]])
