"""MkDocs hooks (mkdocs.yml): the top-level README, CHANGELOG and CONTRIBUTING as site pages.

The Markdown files are written for readers of the source tree, so their links
are repository paths (`docs/lock.md` in README.md, `../CHANGELOG.md` in
docs/versioning.md). Here each such link to a page of the site is pointed at
that page; any other relative link is left alone, so MkDocs' strict link
check still fails on a target the site does not have. Fences marked
```python fragment (see CONTRIBUTING.md) are rendered as plain ```python.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
# Repository file -> its page in the site; docs/X.md is X.md.
TOP_LEVEL = {"README.md": "index.md", "CHANGELOG.md": "changelog.md", "CONTRIBUTING.md": "contributing.md"}
LINK = re.compile(r"(\]\()(?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?(?=[)\s])")
FRAGMENT_FENCE = re.compile(r"^(\s*(?:`{3,}|~{3,}))python fragment\s*$", re.M)


def site_page(repository_path: str) -> str | None:
    if repository_path in TOP_LEVEL:
        return TOP_LEVEL[repository_path]
    if repository_path.startswith("docs/") and repository_path.endswith(".md"):
        return repository_path.removeprefix("docs/")
    return None


def repository_path(page_uri: str) -> str:
    by_page = {page: path for path, page in TOP_LEVEL.items()}
    return by_page.get(page_uri, f"docs/{page_uri}")


def on_files(files: Files, config: Any) -> Files:
    for path, page in TOP_LEVEL.items():
        if files.get_file_from_path(page) is not None:
            raise ValueError(f"docs/{page} would hide {path}, which the hooks publish as {page}")
        files.append(File.generated(config, page, content=(ROOT / path).read_text()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    here = repository_path(page.file.src_uri)

    def relink(match: re.Match[str]) -> str:
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return match[0]
        page_uri = site_page(posixpath.normpath(posixpath.join(posixpath.dirname(here), target)))
        if page_uri is None:
            return match[0]
        relative = posixpath.relpath(page_uri, posixpath.dirname(page.file.src_uri) or ".")
        return f"{match[1]}{relative}{match['anchor'] or ''}"

    return FRAGMENT_FENCE.sub(r"\1python", LINK.sub(relink, markdown))
