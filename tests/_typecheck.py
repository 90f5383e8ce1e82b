"""One mypy run and the two pyright runs that every typing test reads, started side by side.

mypy checks the package and every user-code file of tests/typecheck/ (and one
file that must fail) in a single run, incremental with a cache of its own;
each test then reads the lines of its own files. pyright cannot do both of its
checks in one run (`--verifytypes` ignores file arguments), so it runs twice,
at the same time as mypy.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 600.0

PUBLIC_API_USAGE = "tests/typecheck/public_api_usage.py"
MIDDLEWARE_USAGE = "tests/typecheck/middleware_usage.py"
SYNC_USAGE = "tests/typecheck/sync_usage.py"
SYNC_USAGE_REDLOCK = "tests/typecheck/sync_usage_redlock.py"
# User code that must be refused: a manager of the wrong type, on lines 3 and 4.
WRONG_MANAGER = ("from starlette.applications import Starlette\n"
                 "from otel_lock import LockMiddleware\n"
                 "LockMiddleware(Starlette(), manager='redis://127.0.0.1:6379/0')\n"
                 "LockMiddleware(Starlette(), manager=lambda: 42)\n")
_SUMMARY = re.compile(r"^(?:Success: no issues found in|Found \d+ errors? in \d+ files? \(checked) (\d+) source files?",
                      re.MULTILINE)


def _pyright_env() -> dict[str, str]:
    # pyright resolves imports with the first python on PATH: this venv's.
    return {**os.environ, "VIRTUAL_ENV": sys.prefix,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@dataclass
class Run:
    """A checker started now; `result()` waits for it once and keeps what it said."""

    argv: list[str]
    cwd: Path
    env: dict[str, str] | None = None
    _process: subprocess.Popen[str] | None = None
    _result: tuple[int, str, str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._process = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def result(self) -> tuple[int, str, str]:
        if self._result is None:
            assert self._process is not None
            try:
                out, err = self._process.communicate(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self._process.kill()
                out, err = self._process.communicate()
            self._result = (self._process.returncode, out, err)
        return self._result

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.communicate()


class MypyReport:
    """The one `mypy --strict` run over the package, the usage files and the wrong-manager file."""

    def __init__(self, run: Run, wrong_manager: Path) -> None:
        self.run, self.wrong_manager = run, wrong_manager

    def output(self) -> str:
        code, out, err = self.run.result()
        # 0: no errors, 1: errors found; anything else is mypy failing to check at all.
        assert code in (0, 1), f"mypy did not run (exit {code}): {out[-3000:]}{err[-3000:]}"
        checked = _SUMMARY.search(out)
        assert checked, f"mypy gave no summary: {out[-3000:]}{err[-3000:]}"
        expected = sum(1 for _ in (ROOT / "otel_lock").rglob("*.py")) + 5
        assert int(checked.group(1)) >= expected, f"mypy checked {checked.group(1)} files, expected {expected}"
        return out

    def errors_in(self, path: str) -> list[str]:
        """Error lines of the file or directory `path` (as given on mypy's command line)."""
        prefix = path if path.endswith(".py") else f"{path}/"
        return [line for line in self.output().splitlines() if line.startswith(prefix) and ": error:" in line]


class TypeChecks:
    """mypy and both pyright runs, started together when the first typing test asks."""

    def __init__(self, tmp: Path) -> None:
        cache = Path(".mypy_cache") / f"tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
        # At a fixed path inside the checkout (ignored by git): an incremental run repeats an unchanged
        # file's errors under the path they were cached at.
        wrong = cache.with_name(f"{cache.name}-files") / "wrong_manager.py"
        (ROOT / wrong).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / wrong).write_text(WRONG_MANAGER)
        self.mypy = MypyReport(Run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache),
                                    "otel_lock", PUBLIC_API_USAGE, MIDDLEWARE_USAGE, SYNC_USAGE,
                                    SYNC_USAGE_REDLOCK, str(wrong)], cwd=ROOT), wrong)
        self.pyright_usage = Run([sys.executable, "-m", "pyright", "--outputjson", PUBLIC_API_USAGE],
                                 cwd=ROOT, env=_pyright_env())
        # From outside the checkout, so pyright resolves otel_lock as an installed package
        # (with its py.typed), the way a user's type checker sees it.
        verify_dir = tmp / "verifytypes"
        verify_dir.mkdir()
        self.pyright_verifytypes = Run([sys.executable, "-m", "pyright", "--verifytypes", "otel_lock",
                                        "--ignoreexternal", "--outputjson"], cwd=verify_dir, env=_pyright_env())

    def stop(self) -> None:
        for run in (self.mypy.run, self.pyright_usage, self.pyright_verifytypes):
            run.stop()


def pyright_report(run: Run) -> dict:
    code, out, err = run.result()
    try:
        report: dict = json.loads(out)
    except json.JSONDecodeError:
        raise AssertionError(f"pyright gave no report (exit {code}): {out[-2000:]}{err[-2000:]}") from None
    return report
