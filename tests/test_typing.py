"""Typed like a library people build on: mypy --strict and pyright's public-API completeness.

STRICT_MODULES are the modules that pass `mypy --strict` (pyproject's
[tool.mypy]) today; each rewrite that passes joins the list, until it is the
whole package. Imported modules are analysed but only the listed ones report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STRICT_MODULES = [
    "otel_lock/__init__.py",
    "otel_lock/__main__.py",
    "otel_lock/_extras.py",
    "otel_lock/asgi/__init__.py",
    "otel_lock/asgi/_keys.py",
    "otel_lock/asgi/_types.py",
    "otel_lock/cli/__init__.py",
    "otel_lock/cli/__main__.py",
    "otel_lock/cli/_files.py",
    "otel_lock/cli/_redis_server.py",
    "otel_lock/demo/__init__.py",
    "otel_lock/demo/_problems.py",
    "otel_lock/lock/__init__.py",
    "otel_lock/lock/_errors.py",
    "otel_lock/telemetry/__init__.py",
]
# pyright --verifytypes measured 64.2% at the time of writing (every unknown is in the lock
# core, sync, the telemetry instruments or the middleware). Raise this floor as it improves;
# the goal is 95%.
VERIFYTYPES_FLOOR = 0.60


def test_strict_modules_pass_mypy_strict():
    for module in STRICT_MODULES:
        assert (ROOT / module).is_file(), f"{module} is listed but does not exist"
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                             "--no-incremental", *STRICT_MODULES],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_configured_strict_for_the_whole_package():
    import tomllib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["strict"] is True


def test_pyright_verifytypes_score(tmp_path, record_property):
    # Run from outside the checkout so pyright resolves otel_lock as an installed package
    # (with its py.typed), the way a user's type checker sees it.
    env = {**os.environ, "VIRTUAL_ENV": sys.prefix,
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
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
