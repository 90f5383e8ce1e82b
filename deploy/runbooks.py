"""Render the runbooks of docs/observability.md as the page every Prometheus of the stack serves.

    python deploy/runbooks.py          # rewrites deploy/prometheus/consoles/otel-lock-runbooks.html
    python deploy/runbooks.py --check  # exit 1 if the committed page is stale

The alert rules link to `{{ $externalURL }}/consoles/otel-lock-runbooks.html#<anchor>`:
Prometheus serves the page as a console template (--web.console.templates,
set by docker-compose.yml and `otel-lock stack`), so a link works wherever
the rules run, with no repository or wiki to host it. The page is the
"Alerts and runbooks" section and the troubleshooting checklist, turned into
plain HTML by a deliberately small Markdown subset (headings, paragraphs,
lists, tables, code); `{{` is escaped for Go's template engine.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "docs" / "observability.md"
PAGE = ROOT / "deploy" / "prometheus" / "consoles" / "otel-lock-runbooks.html"
FIRST, LAST = "## Alerts and runbooks", "## Operator questions"
STYLE = ("body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;line-height:1.45}"
         "code,pre{background:#f4f4f4;border-radius:3px}pre{padding:.6em;overflow-x:auto}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).strip().replace(" ", "-")


def inline(text: str, anchors: set[str], headings: frozenset[str] = frozenset()) -> str:
    """Escaped text with `code`, **bold**, links, and the <a id> anchors no heading already has."""
    out = html.escape(text, quote=False)
    out = re.sub(r'&lt;a id="([\w-]+)"&gt;&lt;/a&gt;',
                 lambda m: "" if m.group(1) in headings else f'<a id="{m.group(1)}"></a>', out)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", out)
    out = re.sub(r"(?<![*\w])\*([^*\s][^*]*)\*(?![*\w])", r"<em>\1</em>", out)

    def link(match: re.Match[str]) -> str:
        label, target = match.groups()
        if target.startswith("#") and target[1:] not in anchors:
            return label  # a section of the docs that is not on this page
        if not target.startswith(("#", "http://", "https://")):
            return label  # another docs page: not served here
        return f'<a href="{target}">{label}</a>'
    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", link, out)


_ITEM = re.compile(r"(\d+\.|-) ")


class _Page:
    """The section's lines, read block by block; each reader returns the HTML of one block."""

    def __init__(self, section: str) -> None:
        self.lines = section.splitlines()
        self.i = 0
        self.headings = frozenset(slug(h) for h in re.findall(r"^#+ (.+)$", section, flags=re.M))
        self.anchors = set(re.findall(r'<a id="([\w-]+)">', section)) | self.headings

    def text(self, markdown: str) -> str:
        return inline(markdown, self.anchors, self.headings)

    def block(self) -> str:
        line = self.lines[self.i]
        if line.startswith("```"):
            return self.code()
        if line.startswith("#"):
            self.i += 1
            level, title = len(line) - len(line.lstrip("#")), line.lstrip("#").strip()
            return f'<h{level} id="{slug(title)}">{self.text(title)}</h{level}>'
        if line.startswith("|"):
            return self.table()
        if _ITEM.match(line):
            return self.items()
        return self.paragraph()

    def code(self) -> str:
        end = next((j for j in range(self.i + 1, len(self.lines)) if self.lines[j] == "```"), len(self.lines))
        body = html.escape("\n".join(self.lines[self.i + 1:end]), quote=False)
        self.i = end + 1
        return f"<pre><code>{body}</code></pre>"

    def table(self) -> str:
        rows = []
        while self.i < len(self.lines) and self.lines[self.i].startswith("|"):
            line = self.lines[self.i]
            self.i += 1
            if not re.fullmatch(r"[|\s:-]+", line):
                cells = [self.text(cell.strip()) for cell in line.strip().strip("|").split(" | ")]
                rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
        return "<table>" + "".join(rows) + "</table>"

    def items(self) -> str:
        tag = "ol" if self.lines[self.i][0].isdigit() else "ul"
        items: list[str] = []
        while self.i < len(self.lines) and (_ITEM.match(self.lines[self.i]) or self.lines[self.i].startswith("   ")):
            line = self.lines[self.i]
            self.i += 1
            if _ITEM.match(line):
                items.append(_ITEM.sub("", line, count=1))
            else:
                items[-1] += " " + line.strip()
        return f"<{tag}>" + "".join(f"<li>{self.text(item)}</li>" for item in items) + f"</{tag}>"

    def paragraph(self) -> str:
        words = []
        while self.i < len(self.lines):
            line = self.lines[self.i]
            if not line.strip() or line.startswith(("#", "|", "```")) or _ITEM.match(line):
                break
            words.append(line.strip())
            self.i += 1
        return "<p>" + self.text(" ".join(words)) + "</p>"


def render(markdown: str) -> str:
    page = _Page(markdown[markdown.index(FIRST):markdown.index(LAST)])
    blocks: list[str] = []
    while page.i < len(page.lines):
        if page.lines[page.i].strip():
            blocks.append(page.block())
        else:
            page.i += 1
    body = "\n".join(blocks)
    text = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>otel-lock runbooks</title>'
            f"<style>{STYLE}</style></head>\n<body>\n<p>Generated from docs/observability.md by "
            f"deploy/runbooks.py.</p>\n{body}\n</body></html>\n")
    return text.replace("{{", '{{"{{"}}')  # Prometheus runs the page through Go's text/template


def main(argv: list[str]) -> int:
    page = render(SOURCE.read_text())
    if "--check" in argv:
        if not PAGE.exists() or PAGE.read_text() != page:
            print("stale runbooks page (run python deploy/runbooks.py)", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
