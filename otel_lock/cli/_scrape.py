"""Read lock histograms back from the replicas' /metrics, as Prometheus would.

The summary's wait/hold percentiles come from the library's own
`otel_lock_*_seconds` histograms, summed over replicas and interpolated
within buckets exactly like PromQL `histogram_quantile`, so the numbers
match what a Grafana panel shows for the same burst.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))  # le -> cumulative count
    count: float = 0.0

    def quantile(self, q: float) -> float | None:
        """histogram_quantile(q): linear within the bucket; None without samples."""
        bounds = sorted(self.buckets)
        if not bounds or self.count == 0:
            return None
        rank = q * self.buckets[bounds[-1]]
        lower, below = 0.0, 0.0
        for bound in bounds:
            cumulative = self.buckets[bound]
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower  # like Prometheus: the highest finite bound
                if cumulative == below:
                    return bound
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


@dataclass
class Scrape:
    histograms: dict[tuple[str, str], Histogram] = field(default_factory=lambda: defaultdict(Histogram))
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=lambda: defaultdict(float))

    def histogram(self, metric: str, lock_name: str | None = None) -> Histogram:
        """One metric's buckets summed over replicas (and over lock names unless one is given)."""
        total = Histogram()
        for (name, lock), hist in self.histograms.items():
            if name == metric and lock_name in (None, lock):
                for bound, value in hist.buckets.items():
                    total.buckets[bound] += value
                total.count += hist.count
        return total

    def counter(self, metric: str, **labels: str) -> float:
        return sum(value for (name, items), value in self.counters.items()
                   if name == metric and all(dict(items).get(k) == v for k, v in labels.items()))


async def scrape(client: httpx.AsyncClient, urls: list[str]) -> Scrape:
    result = Scrape()
    for url in urls:
        response = await client.get(url + "/metrics")
        response.raise_for_status()
        _add(result, response.text)
    return result


def _add(result: Scrape, text: str) -> None:
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("otel_lock_"):
            continue
        for sample in family.samples:
            lock = sample.labels.get("lock_name", "")
            if sample.name.endswith("_bucket"):
                result.histograms[(family.name, lock)].buckets[float(sample.labels["le"])] += sample.value
            elif sample.name.endswith("_count") and family.type == "histogram":
                result.histograms[(family.name, lock)].count += sample.value
            elif family.type == "counter" and sample.name.endswith("_total"):
                labels = tuple(sorted(sample.labels.items()))
                result.counters[(sample.name, labels)] += sample.value
