"""The collector's own Prometheus metrics (prometheus-client, a private registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

NS = "ttftscope_collector"


class CollectorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{NS}_requests", "OTLP requests by HTTP status", ["code"], registry=r)
        self.spans_received = Counter(f"{NS}_spans_received", "Spans in decoded requests", registry=r)
        self.spans_accepted = Counter(
            f"{NS}_spans_accepted", "Spans acknowledged (durable in the spool)", registry=r
        )
        self.spans_written = Counter(f"{NS}_spans_written", "Spans written to the store", registry=r)
        self.spans_rejected = Counter(
            f"{NS}_spans_rejected", "Spans rejected as invalid (partial success)", ["reason"], registry=r
        )
        self.spans_dropped = Counter(
            f"{NS}_spans_dropped",
            "Spans refused with 429/503 because the queue was full (the client may retry)",
            registry=r,
        )
        self.queue_spans = Gauge(f"{NS}_queue_spans", "Spans acknowledged but not yet in the store", registry=r)
        self.spool_bytes = Gauge(f"{NS}_spool_bytes", "Bytes in the on-disk spool", registry=r)
        self.requests_over_budget = Counter(
            f"{NS}_requests_over_budget", "Requests refused (429) because the memory budget was in use", registry=r
        )
        self.connections_refused = Counter(
            f"{NS}_connections_refused", "Connections refused (503) past the connection cap", registry=r
        )
        self.parts_quarantined = Gauge(
            f"{NS}_store_parts_quarantined", "Store parts set aside because they could not be read", registry=r
        )
        self.store_up = Gauge(f"{NS}_store_up", "1 when the last store write succeeded", registry=r)
        self.store_errors = Counter(f"{NS}_store_errors", "Failed store writes", registry=r)
        self.batch_write_seconds = Histogram(
            f"{NS}_batch_write_seconds",
            "Time to write one batch to the store",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.batch_spans = Histogram(
            f"{NS}_batch_spans",
            "Spans per store batch",
            buckets=(1, 10, 100, 1000, 5000, 10000, 50000, 100000, 500000),
            registry=r,
        )
        self.store_up.set(1)
        from .phase_metrics import PhaseMetrics

        self.phases = PhaseMetrics(r)
