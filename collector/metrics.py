"""The collector's own Prometheus metrics (prometheus-client, a private registry)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from ttftscope.schemas.metrics import Collector as N


class CollectorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(N.REQUESTS, "OTLP requests by HTTP status", ["code"], registry=r)
        self.spans_received = Counter(N.SPANS_RECEIVED, "Spans in decoded requests", registry=r)
        self.spans_accepted = Counter(
            N.SPANS_ACCEPTED, "Spans acknowledged (durable in the spool)", registry=r
        )
        self.spans_written = Counter(N.SPANS_WRITTEN, "Spans written to the store", registry=r)
        self.spans_rejected = Counter(
            N.SPANS_REJECTED, "Spans rejected as invalid (partial success)", ["reason"], registry=r
        )
        self.spans_dropped = Counter(
            N.SPANS_DROPPED,
            "Spans refused with 429/503 because the queue was full (the client may retry)",
            registry=r,
        )
        self.queue_spans = Gauge(N.QUEUE_SPANS, "Spans acknowledged but not yet in the store", registry=r)
        self.spool_bytes = Gauge(N.SPOOL_BYTES, "Bytes in the on-disk spool", registry=r)
        self.requests_over_budget = Counter(
            N.REQUESTS_OVER_BUDGET, "Requests refused (429) because the memory budget was in use", registry=r
        )
        self.connections_refused = Counter(
            N.CONNECTIONS_REFUSED, "Connections refused (503) past the connection cap", registry=r
        )
        self.parts_quarantined = Gauge(
            N.PARTS_QUARANTINED, "Store parts set aside because they could not be read", registry=r
        )
        self.store_up = Gauge(N.STORE_UP, "1 when the last store write succeeded", registry=r)
        self.store_errors = Counter(N.STORE_ERRORS, "Failed store writes", registry=r)
        self.batch_write_seconds = Histogram(
            N.BATCH_WRITE_SECONDS,
            "Time to write one batch to the store",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.batch_spans = Histogram(
            N.BATCH_SPANS,
            "Spans per store batch",
            buckets=(1, 10, 100, 1000, 5000, 10000, 50000, 100000, 500000),
            registry=r,
        )
        self.group_commit_requests = Histogram(
            N.COMMIT_REQUESTS,
            "Requests acknowledged by one spool sync (group commit)",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.store_up.set(1)
        from .phase_metrics import PhaseMetrics

        self.phases = PhaseMetrics(r)
