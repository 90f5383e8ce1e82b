"""The documentation site builds with `mkdocs build --strict` and documents every public name.

Strict mode turns every warning into a failure: a link to a page or file the
site does not have, an anchor no heading defines, a page left out of the nav,
a docstring mkdocstrings cannot read. The API reference (docs/reference.md)
must then carry a section for each name of `otel_lock.__all__`, the public
classes of `otel_lock.sync`, and `otel_lock.telemetry.setup` with the
`instrument_app` of what it returns; each of those, and their public methods,
has a docstring.
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import otel_lock
import otel_lock.sync

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                reason="the docs tools are the [docs] extra (in [test]): pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}   # Material's notice about MkDocs 2, not about our docs
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    assert "WARNING" not in build.stderr, build.stderr
    return out


def _public_objects() -> dict[str, object]:
    from otel_lock.telemetry import _setup

    found = {f"otel_lock.{name}": getattr(otel_lock, name) for name in otel_lock.__all__}
    found |= {f"otel_lock.sync.{name}": value for name, value in vars(otel_lock.sync).items()
              if inspect.isclass(value) and value.__module__ == "otel_lock.sync" and not name.startswith("_")}
    # The telemetry names are imported on first use (the SDK is an extra); the reference reads _setup.
    found["otel_lock.telemetry._setup.setup"] = _setup.setup
    found["otel_lock.telemetry._setup.TelemetrySetup.instrument_app"] = _setup.TelemetrySetup.instrument_app
    return found


def test_the_site_builds_in_strict_mode_with_every_page(site):
    pages = {p.name for p in site.glob("*.html")}
    expected = {f"{p.stem}.html" for p in (ROOT / "docs").glob("*.md")}
    assert expected | {"index.html", "changelog.html", "contributing.html"} <= pages


def test_every_public_name_has_a_section_in_the_reference(site):
    reference = (site / "reference.html").read_text()
    ids = set(re.findall(r'\bid="([^"]+)"', reference))
    missing = sorted(name for name in _public_objects() if name not in ids)
    assert not missing, f"docs/reference.md renders no section for {missing}"
    assert "otel_lock.telemetry.setup" in html.unescape(reference)   # the heading says the public name


def test_every_public_name_and_method_has_a_docstring():
    undocumented = []
    for name, value in _public_objects().items():
        if name.endswith("__version__"):
            continue
        if not inspect.getdoc(value):
            undocumented.append(name)
        if not inspect.isclass(value):
            continue
        for member_name, member in vars(value).items():
            function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if not member_name.startswith("_") and callable(function) and not (function.__doc__ or "").strip():
                undocumented.append(f"{name}.{member_name}")
    assert not undocumented, f"no docstring: {undocumented}"


def test_readme_is_the_home_page_and_its_links_lead_to_site_pages(site):
    home = (site / "index.html").read_text()
    assert 'href="lock.html"' in home and 'href="changelog.html"' in home
    assert "docs/lock.md" not in re.findall(r'href="([^"]+)"', home)


def test_the_hooks_relink_repository_paths_and_render_fragments_as_python():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec and spec.loader
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    def page(uri: str) -> SimpleNamespace:
        return SimpleNamespace(file=SimpleNamespace(src_uri=uri))

    readme = "[a](docs/lock.md#fencing) [b](CHANGELOG.md) [c](LICENSE) [d](https://example.com/x.md)\n"
    assert hooks.on_page_markdown(readme, page("index.md"), None, None) == \
        "[a](lock.md#fencing) [b](changelog.md) [c](LICENSE) [d](https://example.com/x.md)\n"
    assert hooks.on_page_markdown("[v](../CHANGELOG.md) [m](middleware.md)", page("versioning.md"), None, None) == \
        "[v](changelog.md) [m](middleware.md)"
    fenced = "```python fragment\nawait held.release()\n```\n"
    assert hooks.on_page_markdown(fenced, page("lock.md"), None, None) == "```python\nawait held.release()\n```\n"
