"""Typed like a library people build on: mypy --strict and pyright's public-API completeness.

The whole package passes `mypy --strict` (pyproject's [tool.mypy]), and so
does tests/typecheck/public_api_usage.py, user code that pins the public
types with `assert_type`; pyright must accept that file too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USAGE = "tests/typecheck/public_api_usage.py"
# pyright --verifytypes otel_lock --ignoreexternal measured 100% when the package went
# strict (it was 64.2% before the first typing pass, 88.9% before the second).
# The floor is that measurement: a new public name must come with its types.
VERIFYTYPES_FLOOR = 1.0


def _pyright_env() -> dict[str, str]:
    # pyright resolves imports with the first python on PATH: this venv's.
    return {**os.environ, "VIRTUAL_ENV": sys.prefix,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_the_package_and_the_usage_file_pass_mypy_strict():
    assert (ROOT / USAGE).is_file()
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", "otel_lock", USAGE],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout, result.stdout


def test_pyright_accepts_the_usage_file():
    result = subprocess.run([sys.executable, "-m", "pyright", "--outputjson", USAGE],
                            cwd=ROOT, env=_pyright_env(), capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no report: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    problems = [d for d in report["generalDiagnostics"] if d["severity"] in ("error", "warning")]
    assert problems == [], json.dumps(problems, indent=1)[:4000]
    assert report["summary"]["filesAnalyzed"] >= 1


def test_mypy_is_configured_strict_for_the_whole_package():
    import tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["strict"] is True


def test_pyright_verifytypes_score(tmp_path, record_property):
    # Run from outside the checkout so pyright resolves otel_lock as an installed package
    # (with its py.typed), the way a user's type checker sees it.
    env = _pyright_env()
    result = subprocess.run([sys.executable, "-m", "pyright", "--verifytypes", "otel_lock", "--ignoreexternal",
                             "--outputjson"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright gave no report: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    completeness = report["typeCompleteness"]
    assert completeness["pyTypedPath"], "pyright found no py.typed"
    score = completeness["completenessScore"]
    record_property("verifytypes_score", score)
    print(f"pyright --verifytypes otel_lock: {score:.1%} of exported symbols have known types")
    assert score >= VERIFYTYPES_FLOOR, f"type completeness fell to {score:.1%}"
