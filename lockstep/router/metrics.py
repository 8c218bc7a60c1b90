"""The router's Prometheus metrics, read from its workers' counters at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_PER_WORKER: list[tuple[str, Any, str, Callable[[Any], float]]] = [
    ("requests", CounterMetricFamily, "Attempts sent to each worker.", lambda w: w.requests),
    ("completed", CounterMetricFamily, "Requests answered from each worker.",
     lambda w: w.completed),
    ("failed", CounterMetricFamily, "Failed attempts (connection, 5xx, cut stream).",
     lambda w: w.failed),
    ("in_flight", GaugeMetricFamily, "Requests in flight to each worker.", lambda w: w.load),
    ("healthy", GaugeMetricFamily, "1 while the worker is in rotation.", lambda w: int(w.healthy)),
]


class RouterCollector:
    def __init__(self, workers: Iterable[Any], retries: int) -> None:
        self.workers, self.retries = list(workers), retries

    def collect(self) -> Iterator[Metric]:
        for name, family, doc, value in _PER_WORKER:
            metric = family(f"lockstep_router:{name}", doc, labels=["worker"])
            for w in self.workers:
                metric.add_metric([w.url], value(w))
            yield metric
        yield CounterMetricFamily("lockstep_router:retries", "Attempts retried on another worker.",
                                  value=self.retries)


def render(workers: Iterable[Any], retries: int) -> bytes:
    registry = CollectorRegistry()
    registry.register(RouterCollector(workers, retries))
    return generate_latest(registry)
