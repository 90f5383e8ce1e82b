"""Every `otel-lock <command> --flag` that README.md and docs/*.md tell a reader to type exists.

A mention is `otel-lock COMMAND ...` at the start of a code span or of a
command on a line of a fenced block (up to a comment or a shell separator;
`./scripts/demo ARGS` is `otel-lock demo ARGS`), and a bare `--flag` span in a
paragraph or list item that begins with `otel-lock COMMAND`, or names that one
command and no other tool's. Each is checked
against the parser the real command uses: `otel_lock.cli.main` is called and
its `parse_args` is stopped before anything runs, so `stack`, which parses
its own arguments, is asked too.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

import pytest

try:
    from ._markdown import code_spans, doc_files, fenced_blocks, paragraphs, prose
except ImportError:
    from _markdown import code_spans, doc_files, fenced_blocks, paragraphs, prose

from otel_lock.cli import main

# At the start of a command line: the text's start, a prompt, or a shell separator, then VAR=value words.
# ./scripts/demo passes its arguments to `otel-lock demo`, .venv/bin/otel-lock is the command itself.
COMMAND = re.compile(r"(?:^|\$\s|[;&|(])\s*(?:\w+=\S*\s+)*(?:(?:\S*/)?otel-lock\s+(?P<command>--?[a-z][\w-]*|[a-z][\w-]*)"
                     r"|\./scripts/(?P<script>demo)\b)(?P<rest>[^;&|`]*)")
LEADING = re.compile(r"^(?:[-*+]|\d+\.)?\s*`otel-lock (?P<command>[a-z][\w-]*)")
# A span that is some other tool's command line: its flags are not ours.
OTHER_TOOL = re.compile(r"^(?:\S*python\S*|\S*pip|\./scripts/(?!demo\b)\S+|docker|curl|uv|pytest|promtool)\b")
COMMENT = re.compile(r"(?:^|\s)#.*$")
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")


@dataclass(frozen=True)
class Mention:
    where: str         # file:line or file:paragraph
    command: str       # "locks", or "" for the top-level parser (otel-lock --version)
    flag: str | None   # None: only the command is named


def mentions() -> list[Mention]:
    found: list[Mention] = []

    def scan(text: str, where: str) -> None:
        for match in COMMAND.finditer(text):
            command = match["command"] or match["script"]
            if command.startswith("-"):
                found.append(Mention(where, "", command))
                continue
            found.append(Mention(where, command, None))
            found.extend(Mention(where, command, flag) for flag in FLAG.findall(match["rest"]))

    for path in doc_files():
        name = path.name if path.parent.name != "docs" else f"docs/{path.name}"
        for block in fenced_blocks(path):
            if block.language != "python":
                for offset, line in enumerate(block.source.splitlines(), start=1):
                    scan(COMMENT.sub("", line), f"{name}:{block.line + offset}")
        for number, paragraph in enumerate(paragraphs(prose(path)), start=1):
            where = f"{name}, paragraph {number} ({paragraph.strip()[:40]!r})"
            spans = code_spans(paragraph)
            before = len(found)
            for span in spans:
                scan(span, where)
            named = {m.command for m in found[before:] if m.command}
            leading = LEADING.match(paragraph.strip())
            owner = leading["command"] if leading else None
            if owner is None and len(named) == 1 and not any(OTHER_TOOL.match(span) for span in spans):
                owner = named.pop()
            if owner:
                found.extend(Mention(where, owner, span.split()[0].split("=")[0])
                             for span in spans if FLAG.fullmatch(span.split()[0].split("=")[0]))
    return found


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `otel-lock COMMAND` really uses, caught at its parse_args."""
    def stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", stop)
        try:
            main([command] if command else [])
        except _Parsed as parsed:
            parser = parsed.parser
        else:
            raise AssertionError(f"otel-lock {command} parsed no arguments")
    if not command or parser.prog != "otel-lock":
        return parser
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert command in subcommands.choices, f"otel-lock has no command {command!r}"
    return subcommands.choices[command]


MENTIONS = mentions()
# Flags the docs name that the command does not have; strict, so a fixed one must leave the list.
# None today.
WRONG: dict[tuple[str, str], str] = {}


def _param(command: str, flag: str | None):
    places = sorted({m.where for m in MENTIONS if (m.command, m.flag) == (command, flag)})
    marks = [pytest.mark.xfail(strict=True, reason=WRONG[command, flag])] if (command, flag) in WRONG else []
    return pytest.param(command, flag, places, id=f"{command or 'otel-lock'} {flag or ''}".strip(), marks=marks)


def test_the_docs_name_commands_and_flags():
    assert {m.command for m in MENTIONS} >= {"demo", "serve", "locks", "unlock", "stack"}
    assert len({(m.command, m.flag) for m in MENTIONS if m.flag}) >= 10


@pytest.mark.parametrize("command, flag, places",
                         [_param(c, f) for c, f in sorted({(m.command, m.flag) for m in MENTIONS}, key=str)])
def test_every_documented_command_and_flag_exists(command, flag, places, monkeypatch):
    parser = parser_of(command, monkeypatch)
    if flag is not None:
        assert flag in parser._option_string_actions, \
            f"`otel-lock {command}` has no option {flag}, written in " + "; ".join(places)


def test_a_flag_that_does_not_exist_is_caught(monkeypatch):
    assert "--url" not in parser_of("locks", monkeypatch)._option_string_actions
    assert "--runbook-base" in parser_of("stack", monkeypatch)._option_string_actions
    assert "--version" in parser_of("", monkeypatch)._option_string_actions
    with pytest.raises(AssertionError, match="no command 'lock'"):
        parser_of("lock", monkeypatch)
