"""Optional extras: a missing one is named in the error, with the pip command that installs it.

The core needs only redis, opentelemetry-api and starlette. `[telemetry]` adds
the SDK and exporters behind `otel_lock.telemetry.setup()`, `[cli]` adds what
`otel-lock serve/demo/stack` run on (and `[telemetry]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# Top-level modules (or dotted prefixes) each extra brings in.
_TELEMETRY = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.instrumentation", "prometheus_client")
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "telemetry": _TELEMETRY,
    "cli": (*_TELEMETRY, "uvicorn", "httpx", "yaml"),
}


class MissingExtra(ModuleNotFoundError):
    """A feature was used whose optional dependencies are not installed."""

    def __init__(self, extra: str, feature: str, module: str) -> None:
        super().__init__(f"{feature} needs the [{extra}] extra (module {module!r} is not installed): "
                         f"pip install 'otel-lock[{extra}]'", name=module)
        self.extra = extra
        self.feature = feature


def _belongs(module: str, extra: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in EXTRA_MODULES[extra])


@contextmanager
def requires(extra: str, feature: str) -> Iterator[None]:
    """Turn a ModuleNotFoundError for one of `extra`'s modules into MissingExtra; others pass unchanged."""
    try:
        yield
    except ModuleNotFoundError as exc:  # a MissingExtra of an included extra is named anew

        if exc.name is None or not _belongs(exc.name, extra):
            raise
        raise MissingExtra(extra, feature, exc.name) from exc
