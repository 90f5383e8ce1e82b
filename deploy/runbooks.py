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


def render(markdown: str) -> str:
    section = markdown[markdown.index(FIRST):markdown.index(LAST)]
    headings = frozenset(slug(h) for h in re.findall(r"^#+ (.+)$", section, flags=re.M))
    anchors = set(re.findall(r'<a id="([\w-]+)">', section)) | headings
    blocks: list[str] = []
    lines = section.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("```"):
            end = lines.index("```", i + 1) if "```" in lines[i + 1:] else len(lines)
            blocks.append("<pre><code>" + html.escape("\n".join(lines[i + 1:end]), quote=False) + "</code></pre>")
            i = end + 1
        elif line.startswith("#"):
            level, text = len(line) - len(line.lstrip("#")), line.lstrip("#").strip()
            blocks.append(f'<h{level} id="{slug(text)}">{inline(text, anchors)}</h{level}>')
            i += 1
        elif line.startswith("|"):
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                if not re.fullmatch(r"[|\s:-]+", lines[i]):
                    cells = [inline(cell.strip(), anchors) for cell in lines[i].strip().strip("|").split(" | ")]
                    rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
                i += 1
            blocks.append("<table>" + "".join(rows) + "</table>")
        elif re.match(r"(\d+\.|-) ", line):
            tag = "ol" if line[0].isdigit() else "ul"
            items: list[str] = []
            while i < len(lines) and (re.match(r"(\d+\.|-) ", lines[i]) or lines[i].startswith("   ")):
                if re.match(r"(\d+\.|-) ", lines[i]):
                    items.append(re.sub(r"^(\d+\.|-) ", "", lines[i]))
                else:
                    items[-1] += " " + lines[i].strip()
                i += 1
            blocks.append(f"<{tag}>" + "".join(f"<li>{inline(item, anchors)}</li>" for item in items) + f"</{tag}>")
        else:
            paragraph = []
            while i < len(lines) and lines[i].strip() and not lines[i].startswith(("#", "|", "```")) \
                    and not re.match(r"(\d+\.|-) ", lines[i]):
                paragraph.append(lines[i].strip())
                i += 1
            blocks.append("<p>" + inline(" ".join(paragraph), anchors, headings) + "</p>")
    body = "\n".join(blocks)
    page = (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>otel-lock runbooks</title>'
            f"<style>{STYLE}</style></head>\n<body>\n<p>Generated from docs/observability.md by "
            f"deploy/runbooks.py.</p>\n{body}\n</body></html>\n")
    return page.replace("{{", '{{"{{"}}')  # Prometheus runs the page through Go's text/template


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
