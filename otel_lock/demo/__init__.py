"""The demo shop of otel-lock: stock, orders and a job, safe on many replicas.

`create_app(DemoSettings(...))` builds the Starlette app; `otel-lock serve`
runs it under uvicorn and `otel-lock demo` drives two replicas of it.
"""

from ._app import DemoSettings, create_app

__all__ = ["DemoSettings", "create_app"]
