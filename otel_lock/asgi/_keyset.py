"""The keys of one annotation: several templates, lists walked with `*`, duplicates folded, a bound.

`@locked("account:{json.from_id}", "account:{json.to_id}")` names two keys;
`@locked("stock:{json.items.*.sku}")` one key per element of the list. The
keys of a request are folded (a transfer to oneself is one key), sorted
(the manager takes them in its own canonical order anyway; sorted here,
the same request always names the same tuple), and bounded by `max_keys`:
a request naming more distinct keys is refused (422 `lock-keys-too-many`)
before anything is taken. A list with no elements names no keys: such a
request takes nothing for that template (docs/middleware.md, "Several keys").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterable, Iterator

from ._keys import KeyTemplate, Part, TemplateValueError


class Each:
    """The texts of a `*` placeholder, one per element, rendered as they are first read.

    A request refused for naming too many keys stops reading here, so a list
    of ten thousand items costs the walk of about `max_keys` of them; any
    template naming the placeholder reads the ones already rendered again.
    """

    __slots__ = ("_source", "_read")

    def __init__(self, texts: Iterable[str | None]) -> None:
        self._source: Iterator[str | None] | None = iter(texts)
        self._read: list[str | None] = []

    def __iter__(self) -> Iterator[str | None]:
        i = 0
        while True:
            if i < len(self._read):
                yield self._read[i]
            elif self._source is None:
                return
            else:
                try:
                    text = next(self._source)
                except StopIteration:
                    self._source = None
                    return
                self._read.append(text)
                yield text
            i += 1


# A placeholder's rendered value: one text (None: absent, optional), or one per element for `{json.items.*.sku}`.
Value = str | None | Each


class TooManyKeys(TemplateValueError):
    """A request names more distinct keys than the rule's `max_keys` (-> 422 lock-keys-too-many)."""


@dataclass(frozen=True)
class KeySet:
    """The parsed templates of one annotation, ready to render a request's keys."""

    templates: tuple[KeyTemplate, ...]

    @property
    def template(self) -> str:
        """The templates as written: the lock's default metric/span name."""
        return ", ".join(t.template for t in self.templates)

    @cached_property  # read on every request: computed once (the templates never change)
    def parts(self) -> tuple[Part, ...]:
        """Every distinct placeholder, in order (one value per placeholder, however many templates name it)."""
        return tuple(dict.fromkeys(p for t in self.templates for p in t.parts))

    @property
    def needs_body(self) -> bool:
        return any(t.needs_body for t in self.templates)

    @property
    def several(self) -> bool:
        """Whether a request may name more than one key (several templates, or a list walked with `*`)."""
        return len(self.templates) > 1 or any(p.many for p in self.parts)

    def render(self, lookup: Callable[[Part], Value], secret: bytes | None = None,
               max_keys: int | None = None) -> tuple[str, ...]:
        """The request's keys: folded, sorted, at most `max_keys` of them (else TooManyKeys)."""
        keys: dict[str, None] = {}
        for template in self.templates:
            for values in _combinations(template, lookup):
                keys[template.render(values.__getitem__, secret)] = None
                if max_keys is not None and len(keys) > max_keys:
                    raise TooManyKeys(f"the request names more than {max_keys} distinct lock keys "
                                      f"({self.template!r}); send fewer items at once")
        return tuple(sorted(keys))


def _combinations(template: KeyTemplate, lookup: Callable[[Part], Value]) -> Iterator[dict[Part, str | None]]:
    """One value per placeholder for each key of the template: its `*` placeholder's elements, one by one."""
    fixed: dict[Part, str | None] = {}
    many: tuple[Part, Each] | None = None
    for part in template.parts:
        value = lookup(part)
        if isinstance(value, Each):
            many = (part, value)
        else:
            fixed[part] = value
    if many is None:
        yield fixed
        return
    part, values = many
    for value in values:
        yield {**fixed, part: value}


def check_one_wildcard(template: KeyTemplate) -> None:
    """A template walks at most one list (two would pair their elements in no stated way); ValueError else."""
    walked = [p.text for p in template.parts if p.many]
    if len(walked) > 1:
        raise ValueError(f"lock key template {template.template!r} walks several lists ({', '.join(walked)}): "
                         f"one '*' placeholder per template; write a template per list instead")
