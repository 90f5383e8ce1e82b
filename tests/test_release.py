"""A release a stranger can trust: a changelog in Keep a Changelog form, and classifiers that are true.

CHANGELOG.md opens with an [Unreleased] section, then one section per release,
newest first, each `## [X.Y.Z] - YYYY-MM-DD` with only Keep a Changelog's
kinds of change; the newest release is `otel_lock.__version__` (a release
renames [Unreleased] and bumps the version in one commit). The Python
classifiers name exactly the Pythons CI runs: the lowest `requires-python`
allows (the whole suite) and scripts/test's NEWEST_PYTHON (the lock and
middleware tests).
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import tomllib
from pathlib import Path

import pytest

import otel_lock

ROOT = Path(__file__).resolve().parents[1]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?")


def _sections() -> list[str]:
    return re.findall(r"^## (.+)$", CHANGELOG, flags=re.M)


def test_changelog_opens_with_unreleased_then_releases_newest_first():
    sections = _sections()
    assert CHANGELOG.startswith("# Changelog\n")
    assert "https://keepachangelog.com/en/1.1.0/" in CHANGELOG and "https://semver.org/spec/v2.0.0.html" in CHANGELOG
    assert sections[0] == "[Unreleased]", sections
    versions, dates = [], []
    for heading in sections[1:]:
        match = re.fullmatch(r"\[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d{2}-\d{2})", heading)
        assert match and SEMVER.fullmatch(match["version"]), f"release heading {heading!r}: ## [X.Y.Z] - YYYY-MM-DD"
        versions.append(tuple(int(n) for n in match["version"].split("-")[0].split(".")))
        dates.append(datetime.date.fromisoformat(match["date"]))
    assert versions and versions == sorted(versions, reverse=True) and len(set(versions)) == len(versions)
    assert dates == sorted(dates, reverse=True)


def test_the_newest_release_is_the_package_version():
    newest = _sections()[1].split("]")[0].lstrip("[")
    assert newest == otel_lock.__version__, (
        f"CHANGELOG.md's newest release is {newest}, otel_lock.__version__ is {otel_lock.__version__}: "
        "a release renames [Unreleased] and bumps the version together")


def test_changes_are_grouped_by_keep_a_changelog_kinds():
    kinds = re.findall(r"^### (.+)$", CHANGELOG, flags=re.M)
    assert kinds and set(kinds) <= KINDS, f"unknown kinds of change: {set(kinds) - KINDS}"
    for section in re.split(r"^## ", CHANGELOG, flags=re.M)[1:]:
        found = re.findall(r"^### (.+)$", section, flags=re.M)
        assert len(found) == len(set(found)), f"a kind repeated in ## {section.splitlines()[0]}"


def _classified_pythons() -> set[str]:
    return {c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"]
            if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}


def test_the_python_classifiers_are_exactly_the_pythons_ci_runs():
    lowest = re.fullmatch(r">=\s*(3\.\d+)", PROJECT["requires-python"])
    newest = re.search(r"^NEWEST_PYTHON=(3\.\d+)$", (ROOT / "scripts" / "test").read_text(), flags=re.M)
    assert lowest and newest, "requires-python or scripts/test's NEWEST_PYTHON changed shape"
    assert _classified_pythons() == {lowest[1], newest[1]}


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="CI's own Python; yours may be any other")
def test_ci_runs_the_main_suite_on_the_lowest_python():
    """.ci/run builds .venv with the machine's python3: it must be the lowest classified one."""
    running = "%d.%d" % sys.version_info[:2]
    assert running == min(_classified_pythons(), key=lambda v: tuple(map(int, v.split("."))))


def test_contributing_names_paths_that_exist():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    paths = set(re.findall(r"(?<![\w./-])((?:\./)?(?:scripts|tests|constraints|docs|benchmarks)/[\w./-]*\w)", text))
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"
