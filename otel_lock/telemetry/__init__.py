"""Telemetry: the lock's instruments (OpenTelemetry API only) and `setup()` for apps without an SDK.

`setup`, `current`, `metrics_endpoint` and `TelemetrySetup` need the
`[telemetry]` extra; they are imported on first use, so the core never loads
the SDK (without the extra, first use raises an ImportError naming it).
"""

from typing import Any

_SETUP_NAMES = ("TelemetrySetup", "current", "default_instance_id", "metrics_endpoint", "setup", "_reset_for_tests")

__all__ = ["TelemetrySetup", "configure_redaction", "current", "default_instance_id", "metrics_endpoint", "setup"]


def __getattr__(name: str) -> Any:
    if name == "configure_redaction":
        from ._redact import configure_redaction

        return configure_redaction
    if name in _SETUP_NAMES:
        from .._extras import requires

        with requires("telemetry", f"otel_lock.telemetry.{name}"):
            from . import _setup
        return getattr(_setup, name)
    raise AttributeError(f"module 'otel_lock.telemetry' has no attribute {name!r}")
