"""Honest links: no URL leads to a repository or site that does not exist.

The project has no public repository or documentation site (yet), so the docs
link by path inside the source tree and pyproject.toml names no URL. Every
public URL in the docs, the metadata, the package and what the wheel ships
must start with a base known to exist (below: add one only after opening it),
or use a name reserved for examples (RFC 2606 / 6761) or a local host. Nor
do the docs cite what a reader cannot open: the design notes or issue numbers.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Bases that lead nowhere: the repository and sites this project never had.
DEAD = ("github.com/otel-lock", "otel-lock.github.io", "otel-lock.readthedocs.io", "readthedocs.org/projects/otel-lock")
# Public URLs the docs may cite: each base was opened and exists.
REAL = (
    "https://github.com/redis/redis/",
    "https://datatracker.ietf.org/doc/",
    "https://keepachangelog.com/en/1.1.0/",
    "https://semver.org/spec/v2.0.0.html",
)
URL = re.compile(r"https?://[^\s\"'<>)`\]|]+")
RESERVED = re.compile(r"(^|\.)(example|test|invalid|localhost)$|(^|\.)example\.(com|net|org)$")
# Files another engineer is changing this round (the runbook links of the alert rules and
# `otel-lock stack --runbook-base`): strict, so each entry goes
# when its file is fixed.
PENDING: dict[str, str] = {}  # files known to hold a dead URL, each with why (none left)


def scanned() -> list[Path]:
    """The docs, the metadata, the package, and the rules and dashboards the wheel ships."""
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md", ROOT / "pyproject.toml",
             ROOT / "mkdocs.yml", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("otel_lock", "deploy", "dashboards"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in
                        {".py", ".md", ".yml", ".yaml", ".json", ".txt", ".toml", ".html"})
    return files


def public_url_problems(text: str) -> list[str]:
    problems = []
    for url in URL.findall(text):
        host = (urlsplit(url).hostname or "").lower()
        if any(dead in url for dead in DEAD):
            problems.append(f"{url} (no such repository or site)")
        elif "." in host and not re.fullmatch(r"[\d.]+", host) and "{" not in host and not RESERVED.search(host) \
                and not url.startswith(REAL):
            problems.append(f"{url} (not a base known to exist: open it, then add it to REAL)")
    return problems


def test_no_url_leads_nowhere():
    problems = [f"{path.relative_to(ROOT)}: {problem}" for path in scanned()
                if str(path.relative_to(ROOT)) not in PENDING for problem in public_url_problems(path.read_text())]
    assert len(scanned()) > 50
    assert not problems, "\n".join(sorted(set(problems)))


def test_the_scan_tells_dead_and_unknown_bases_from_real_and_reserved_ones():
    assert public_url_problems("see https://github.com/otel-lock/otel-lock/issues") != []
    assert public_url_problems("docs at https://otel-lock.readthedocs.io/en/latest/") != []
    assert public_url_problems("https://github.com/someone/else") != []
    assert public_url_problems("https://github.com/redis/redis/pull/8474 and https://grafana.example.com/d/x "
                               "and https://shop.example and http://localhost:3000 and http://app1:8000 "
                               "and http://127.0.0.1:8001 and http://{host}:{port}/x") == []


def test_pyproject_names_no_project_url():
    """Placeholders removed rather than invented; add [project.urls] when a real home exists."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "urls" not in project


def test_readme_links_are_paths_that_exist_in_the_source_tree():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [link.split("#", 1)[0] for link in links if not re.match(r"^[a-z]+:", link)]
    assert len(relative) >= 8, links
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README.md links to paths that do not exist: {missing}"


# -- references a reader cannot follow ------------------------------------------------------------

# The project's design notes and issue tracker are not published with it.
UNSEEN = re.compile(r"\bDESIGN\b|DESIGN\.md|§\s*\d|\b[Ii]ssues? #?\d+|\b[Ii]ssue-\d+")
# Docs known to cite them, each with where; strict, so each entry goes with its fix. None today.
CITING: dict[str, str] = {}


def _readable() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _citations(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {match[0]!r}"
            for number, line in enumerate(path.read_text().splitlines(), start=1)
            for match in UNSEEN.finditer(line)]


def test_no_reference_to_documents_or_issues_a_reader_cannot_see():
    found = [c for path in _readable() if str(path.relative_to(ROOT)) not in CITING for c in _citations(path)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("relative", [pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=reason))
                                      for path, reason in CITING.items()])
def test_no_reference_a_reader_cannot_see_in_the_docs_being_reworded(relative: str):
    found = _citations(ROOT / relative)
    assert not found, "\n".join(found)


def test_the_citation_scan_finds_design_sections_and_issue_numbers():
    assert UNSEEN.search("Operator questions (DESIGN §5)") and UNSEEN.search("(issue 11)")
    assert UNSEEN.search("the issue-7 hand-over") and UNSEEN.search("issues #4 and 9")
    assert not UNSEEN.search("a design choice; an issue with the pool; 5 issues")
