"""OpenTelemetry plumbing for the plugin: a bounded, never-blocking span processor.

``BoundedBatchSpanProcessor`` is the SDK's batch processor idea with the guarantees the
plugin needs inside vLLM: ``on_end`` is O(1) and never blocks (a full queue drops the span
and counts it), memory is bounded by ``max_queue``, export happens on one daemon thread
with a short timeout, so a slow or dead collector costs vLLM nothing but dropped spans.
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


class BoundedBatchSpanProcessor(SpanProcessor):
    def __init__(self, exporter: SpanExporter, *, max_queue: int = 8192, max_batch: int = 512,
                 interval_s: float = 0.5) -> None:
        self.exporter = exporter
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

    def _drain(self) -> None:
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
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self._drain()

    def shutdown(self) -> None:
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
