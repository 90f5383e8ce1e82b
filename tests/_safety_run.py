"""Run `python -m benchmarks.safety --quick` as the CI does, for the checker's tests (test_safety_*.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_checker(out: Path, *args: str) -> tuple[int, list[dict]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.safety", "--quick", "--json", str(out), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    except subprocess.TimeoutExpired as timeout:
        said = [(part.decode(errors="replace") if isinstance(part, bytes) else part or "")[-3000:]
                for part in (timeout.stdout, timeout.stderr)]
        pytest.fail("the checker did not finish within 400 s; it printed:\n" + "\n".join(said))
    if not out.exists():
        pytest.fail(f"the checker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.returncode, json.loads(out.read_text())["rows"]
