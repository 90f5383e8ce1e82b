"""otel-lock: an asyncio Redis lock for Starlette/FastAPI replicas, observable with OpenTelemetry."""

__version__ = "0.1.0"
