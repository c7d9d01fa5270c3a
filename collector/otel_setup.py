"""OpenTelemetry plumbing for the plugin: a bounded, never-blocking span processor.

``BoundedBatchSpanProcessor`` is the SDK's batch processor idea with the guarantees the
plugin needs inside vLLM: ``on_end`` is O(1) and never blocks (a full queue drops the span
and counts it), memory is bounded by ``max_queue``, export happens on one daemon thread
with a short timeout, so a slow or dead collector costs vLLM nothing but dropped spans.

``DeferredSpans`` takes even span creation off the serving threads: a hook appends one
tuple (about a microsecond; building an SDK span costs ~20 us, encoding it ~25 us more) and
the export thread turns the tuples into SDK spans just before it exports them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("vllm.ttftscope")

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/traces"


def traces_endpoint() -> str:
    """OTLP/HTTP traces endpoint: TTFTSCOPE_ENDPOINT, else the standard OTEL_* variables."""
    if v := os.environ.get("TTFTSCOPE_ENDPOINT"):
        return v
    if v := os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return v
    if v := os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return v.rstrip("/") + "/v1/traces"
    return DEFAULT_ENDPOINT


class DeferredSpans:
    """Finished spans as plain tuples, bounded; ``materialize`` makes SDK spans of them.

    ``parent`` is the W3C trace headers of the request (``{"traceparent": ...}``), an
    OpenTelemetry ``Context``, or None for a new trace."""

    def __init__(self, tracer, *, max_queue: int = 8192, max_batch: int = 512) -> None:
        self.tracer = tracer
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.dropped = 0
        self.wake = None  # set by the processor: called when a batch is ready
        self._q: deque[tuple] = deque()

    def add(self, name: str, start_s: float, end_s: float, attrs: dict, parent=None) -> None:
        if len(self._q) >= self.max_queue:
            self.dropped += 1
            return
        self._q.append((name, start_s, end_s, attrs, parent))
        if len(self._q) == self.max_batch and self.wake is not None:
            self.wake()

    def materialize(self) -> int:
        from opentelemetry.context import Context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        prop = TraceContextTextMapPropagator()
        n = 0
        while self._q:
            name, start_s, end_s, attrs, parent = self._q.popleft()
            # a Context is a dict too: check it first
            ctx = parent if isinstance(parent, Context) or not parent else prop.extract(parent)
            span = self.tracer.start_span(name, context=ctx, start_time=int(start_s * 1e9), attributes=attrs)
            span.end(end_time=int(max(end_s, start_s) * 1e9))
            n += 1
        return n


class BoundedBatchSpanProcessor(SpanProcessor):
    def __init__(self, exporter: SpanExporter, *, max_queue: int = 8192, max_batch: int = 512,
                 interval_s: float = 0.5) -> None:
        self.exporter = exporter
        self.sources: list[DeferredSpans] = []
        self.max_batch = max_batch
        self.interval_s = interval_s
        self._q: deque[ReadableSpan] = deque()
        self.max_queue = max_queue
        self.dropped = 0
        self.exported = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_warn = 0.0
        self._t = threading.Thread(target=self._run, name="ttftscope-export", daemon=True)
        self._t.start()

    def on_start(self, span, parent_context=None) -> None:  # noqa: D401 - nothing to do
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        if len(self._q) >= self.max_queue:
            self.dropped += 1
            return
        self._q.append(span)
        if len(self._q) >= self.max_batch:
            self._wake.set()

    def add_source(self, src: DeferredSpans) -> None:
        """Deferred spans to materialize on the export thread before each export."""
        src.wake = self._wake.set
        self.sources.append(src)

    def _drain(self) -> None:
        for src in self.sources:
            try:
                src.materialize()
            except Exception:  # noqa: BLE001 - a bad span must not stop the export thread
                log.exception("ttftscope: could not build a span")
        while self._q:
            batch = []
            while self._q and len(batch) < self.max_batch:
                batch.append(self._q.popleft())
            try:
                res = self.exporter.export(batch)
                ok = getattr(res, "name", "SUCCESS") == "SUCCESS"
            except Exception:  # noqa: BLE001 - exporter failures must never reach vLLM
                ok = False
            if ok:
                self.exported += len(batch)
            else:
                self.failed += len(batch)
                now = time.monotonic()
                if now - self._last_warn > 30:
                    self._last_warn = now
                    log.warning("ttftscope: could not export %d spans (collector down?); "
                                "dropped so far: %d queue-full, %d failed", len(batch), self.dropped, self.failed)
                return  # back off until the next interval

    def _run(self) -> None:
        self.cpu_s = 0.0  # this thread's CPU time (TTFTSCOPE_SELF_TIMING reports it)
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            t = time.thread_time()
            self._drain()
            self.cpu_s += time.thread_time() - t

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._t.join(timeout=5)
        self._drain()
        try:
            self.exporter.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._drain()
        return not self._q
