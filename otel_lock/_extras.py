"""Optional extras: a missing one is named in the error, with the pip command that installs it.

The core needs only redis, opentelemetry-api and starlette. `[telemetry]` adds
the SDK and exporters behind `otel_lock.telemetry.setup()`, `[cli]` adds what
`otel-lock serve/demo/stack` run on (and `[telemetry]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec

# The modules each extra brings in (prometheus_client alone, for instance, is not the extra).
_TELEMETRY = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.exporter.prometheus",
              "opentelemetry.instrumentation.asgi", "prometheus_client")
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
    """`module` is one of the extra's modules, inside one, or a package above one."""
    return any(module == wanted or module.startswith(wanted + ".") or wanted.startswith(module + ".")
               for wanted in EXTRA_MODULES[extra])


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package is missing, or a stub without a spec
        return False


@contextmanager
def requires(extra: str, feature: str) -> Iterator[None]:
    """Check that every module of `extra` is installed (without importing it), then run the block;
    a ModuleNotFoundError for one of them inside the block also becomes MissingExtra."""
    for module in EXTRA_MODULES[extra]:
        if not _installed(module):
            raise MissingExtra(extra, feature, module)
    try:
        yield
    except ModuleNotFoundError as exc:  # a MissingExtra of an included extra is named anew
        if exc.name is None or not _belongs(exc.name, extra):
            raise
        raise MissingExtra(extra, feature, exc.name) from exc
