"""The jobs of ./scripts/test partition the suite: every test runs in exactly one (tests/_jobs.py).

conftest.py refuses a collection in which a test falls in no job or in two;
these tests keep the pieces that check relies on honest: the expressions, the
names in MARKS, the quick set and the script that runs the jobs.
"""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

from _jobs import JOBS, MARKS, QUICK, jobs_of, marks_for, misplaced

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SCRIPT = (ROOT / "scripts" / "test").read_text()


def _test_functions(module: str) -> set[str]:
    tree = ast.parse((TESTS / module).read_text())
    return {node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def test_every_combination_of_marks_is_in_exactly_one_job():
    marks = ["serial", "failover", "tooling", "system", "timeout", "parametrize"]
    for size in range(len(marks) + 1):
        for combination in itertools.combinations(marks, size):
            assert len(jobs_of(combination)) == 1, (combination, jobs_of(combination))
    assert jobs_of([]) == ["behaviour"] and jobs_of(["failover"]) == ["serial"]
    assert jobs_of(["serial", "tooling"]) == ["tooling"] and jobs_of(["system", "serial"]) == ["system"]


def test_a_test_in_two_jobs_or_none_is_named():
    # What conftest.py raises on, had a job's expression been written to overlap another or leave a gap.
    assert misplaced([("t.py::ok", ["serial"])]) == []
    original = dict(JOBS)
    try:
        JOBS["serial"] = "serial or failover"  # overlaps tooling and system
        assert misplaced([("t.py::both", ["serial", "tooling"])]) == ["t.py::both: in serial, tooling"]
        JOBS["system"] = "system and not serial"  # leaves system-and-serial nowhere
        del JOBS["serial"]
        assert misplaced([("t.py::none", ["serial", "system"])]) == ["t.py::none: in no job"]
    finally:
        JOBS.clear()
        JOBS.update(original)


def test_every_name_in_marks_is_a_test_module_or_function_that_exists():
    for mark, where in MARKS.items():
        for entry in where:
            module, _, function = entry.partition("::")
            assert (TESTS / module).is_file(), f"{mark}: {module} does not exist"
            if function:
                assert function in _test_functions(module), f"{mark}: {entry} does not exist"
    assert marks_for("test_redlock.py", "test_anything") == ["serial"]
    assert marks_for("test_lock.py", "test_anything") == []


def test_the_quick_set_is_the_lock_core_and_the_middleware_and_mostly_behaviour():
    for path in QUICK:
        module = Path(path).name
        assert (ROOT / path).is_file(), path
        assert module not in sum(MARKS.values(), []), f"{module} is wholly outside the behaviour job"
    assert {"tests/test_lock.py", "tests/test_middleware.py"} <= set(QUICK)


def test_the_script_runs_each_job_once_with_its_expression_from_here():
    runs = re.findall(r"^run_job (\w+)", SCRIPT, re.MULTILINE)
    assert sorted(runs) == sorted(JOBS), runs
    assert 'run_job behaviour "${WORKERS[@]}"' in SCRIPT and "WORKERS=(-n 2" in SCRIPT
    assert '-m "$(job_marks "$name")"' in SCRIPT and "tests/_jobs.py" in SCRIPT
    for name, expression in JOBS.items():
        printed = subprocess.run([sys.executable, str(TESTS / "_jobs.py"), name], capture_output=True, text=True,
                                 check=True).stdout.strip()
        assert printed == expression
