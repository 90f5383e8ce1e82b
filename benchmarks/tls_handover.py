"""The 8-process hand-over over TLS against plain TCP, side by side in one run.

    .venv/bin/python -m benchmarks.tls_handover                # 2 rounds of 4 s per row, about 40 s on 2 CPUs
    .venv/bin/python -m benchmarks.tls_handover --rounds 1 --duration 2

One redis-server on loopback with a plain port and a TLS port (the CA and
certificates of `benchmarks/tls_burst.py`, made in a temporary directory);
stopped at the end. Each row is `bench_lock.contended`: 8 worker
processes, one waiter each, contending for one key with a tiny critical
section, on `redis://` or on `rediss://` (both on the lean connection: one
TLS connection and one TLS subscriber per process). Rows are interleaved
round by round; the best round by handoffs/s is shown, with every round's
value and the machine's load average at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from otel_lock.cli._redis_server import RedisServer, free_port

from ._harness import best_rounds
from .bench_lock import contended
from .tls_burst import make_certificates


def main(rounds: int, duration: float) -> None:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="otel-lock-tls-") as folder:
        certs = Path(folder)
        make_certificates(certs)
        tls_port = free_port()
        server = RedisServer(extra_args=(
            "--tls-port", str(tls_port), "--tls-cert-file", str(certs / "server.crt"),
            "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
            "--tls-auth-clients", "no"))
        server.start()
        plain = server.url
        rows = [("redis://", plain, {}),
                ("rediss://", f"rediss://127.0.0.1:{tls_port}/0", {"ssl_ca_certs": str(certs / "ca.crt")})]
        found = []
        try:
            for _ in range(rounds):
                for name, url, options in rows:  # interleaved: the machine's state is shared fairly
                    row = contended("otel-lock", url, duration, options=options, servers=[plain])
                    found.append({**row, "lib": name})
        finally:
            server.stop()
    load_after = os.getloadavg()
    best = best_rounds(found, "handoffs_per_s", higher=True)
    base = best[0]["handoffs_per_s"]
    print(f"8 processes, one waiter each, one key; best of {rounds} rounds of {duration:g} s; "
          f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} (2 CPUs)")
    print(f"{'row':10} {'handoffs/s':>10} {'x plain':>8} {'wait p50 ms':>11} {'wait p99 ms':>11} "
          f"{'busiest':>8} {'overlaps':>8} {'client CPU ms/handoff':>21}  rounds")
    for row in best:
        print(f"{row['lib']:10} {row['handoffs_per_s']:10.0f} {row['handoffs_per_s'] / base:8.2f} "
              f"{row['wait_p50_ms']:11.2f} {row['wait_p99_ms']:11.2f} {row['busiest_share']:8.2f} "
              f"{row['overlaps']:8d} {row['client_cpu_ms_per_handoff']:21.3f}  {row['rounds']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=4.0)
    arguments = parser.parse_args()
    main(arguments.rounds, arguments.duration)
