"""Benchmarks: otel-lock side by side with redis-py's Lock, python-redis-lock and pottery.

Not tests: nothing here asserts a timing. `python -m benchmarks.run --quick`
runs everything against throwaway redis-servers and writes
benchmarks/results/*.json plus the markdown tables of docs/benchmarks.md.
"""
