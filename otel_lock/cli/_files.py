"""Where `otel-lock stack` finds the Prometheus config, the alert rules and the dashboards.

A wheel carries copies of the repository's deploy/prometheus and
dashboards/*.json under `otel_lock/_data` (mapped at build time, see
pyproject.toml), read here through importlib.resources. A checkout or an
editable install has no such copy and reads the repository's own folders, so
the compose stack and the local stack always use the same files.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2]


class DataFilesMissing(FileNotFoundError):
    """A file the command needs is neither in the installed package nor in a checkout."""


def data_dir(name: str) -> Path:
    """`name` ("deploy/prometheus", "dashboards") from the installed package, else from the checkout."""
    packaged = files("otel_lock").joinpath("_data", *name.split("/"))
    if isinstance(packaged, Path) and packaged.is_dir():
        return packaged
    return _CHECKOUT / name


def prometheus_dir() -> Path:
    return data_dir("deploy/prometheus")


def dashboards_dir() -> Path:
    return data_dir("dashboards")


def check_prometheus_files() -> tuple[Path, list[Path]]:
    """The Prometheus config and its rule files (and the runbooks page), or DataFilesMissing naming what is absent."""
    directory = prometheus_dir()
    config = directory / "prometheus.yml"
    rules = sorted((directory / "rules").glob("*.yml"))
    runbooks = directory / "consoles" / "otel-lock-runbooks.html"
    if not config.is_file() or not rules or not runbooks.is_file():
        missing = (config if not config.is_file() else runbooks if rules else directory / "rules" / "*.yml")
        raise DataFilesMissing(
            f"{missing} not found: this otel-lock installation lacks its Prometheus files "
            "(reinstall the wheel, or run from a checkout of the repository)")
    return config, rules
