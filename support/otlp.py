"""OTLP for the tests and the benchmarks: spans sent with the stock OpenTelemetry Python SDK
(with the SDK's own record of them), raw requests with exact bytes, plugin-shaped requests,
and a sender that remembers exactly what the collector acknowledged."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable

import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

PB = {"Content-Type": "application/x-protobuf"}


def make_exporter(endpoint: str, encoding: str, compression: str = "none", **kw):
    """The stock OTLP/HTTP exporter for ``encoding`` (protobuf or json)."""
    if encoding == "protobuf":
        from opentelemetry.exporter.otlp.proto.http import Compression
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        comp = {"none": Compression.NoCompression, "gzip": Compression.Gzip, "deflate": Compression.Deflate}
    else:
        from opentelemetry.exporter.otlp.json.http._internal import Compression
        from opentelemetry.exporter.otlp.json.http.trace_exporter import OTLPSpanExporter

        comp = {"none": Compression.NONE, "gzip": Compression.GZIP, "deflate": Compression.DEFLATE}
    return OTLPSpanExporter(endpoint=endpoint + "/v1/traces", compression=comp[compression], **kw)


def emit_rich_spans(endpoint: str, encoding: str, service: str, n: int = 20, **exporter_kw):
    """Emit ``n`` request trees with every OTLP feature; return the SDK's finished spans."""
    memory = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({ResourceAttr.SERVICE_NAME: service, ResourceAttr.SERVICE_VERSION: "9.9.9",
                                                  ResourceAttr.HOST_NAME: "h1", ResourceAttr.RUN: "test"}))
    tp.add_span_processor(SimpleSpanProcessor(memory))
    tp.add_span_processor(BatchSpanProcessor(make_exporter(endpoint, encoding, **exporter_kw),
                                             schedule_delay_millis=100))
    tr = tp.get_tracer("ttftscope.tests", "1.2.3")
    foreign = SpanContext(trace_id=0xABCDEF0123456789ABCDEF0123456789, span_id=0x1122334455667788,
                          is_remote=True, trace_flags=TraceFlags(1))
    for i in range(n):
        with tr.start_as_current_span(
            SpanName.REQUEST, kind=SpanKind.SERVER,
            attributes={Attr.REQUEST_ID: f"req-{i}", "i": i, "ratio": 0.25 + i, "flag": i % 2 == 0,
                        "tags": ["a", "b"], "ints": [1, 2, 3], "unicode": "héllo ✓"},
            links=[Link(foreign, {"link.kind": "follows"})],
        ) as root:
            root.add_event("first_token", {"tokens": 3, "where": "api"})
            with tr.start_as_current_span(SpanName.QUEUE, kind=SpanKind.INTERNAL) as q:
                q.set_attribute(Attr.WAITING, i)
            with tr.start_as_current_span(SpanName.PREFILL, kind=SpanKind.CLIENT) as p:
                p.set_status(Status(StatusCode.ERROR, f"chunk {i} failed"))
            root.set_status(Status(StatusCode.OK))
    tp.force_flush()
    tp.shutdown()
    return memory.get_finished_spans()


def otlp_request(n_spans: int, *, name: str = "ok", service: str = "svc", start: int | None = None,
                 end: int | None = None, n_attrs: int = 0,
                 ids: Callable[[int], tuple[int, int]] = lambda i: (i + 1, i + 1)):
    """A raw ``ExportTraceServiceRequest``: one resource, ``n_spans`` spans whose
    (trace id, span id) are ``ids(i)``, integer attributes k0..k{n_attrs-1}."""
    req, ss = _request({ResourceAttr.SERVICE_NAME: service})
    now = time.time_ns()
    for i in range(n_spans):
        sp = ss.spans.add()
        tid, sid = ids(i)
        sp.trace_id, sp.span_id = tid.to_bytes(16, "big"), sid.to_bytes(8, "big")
        sp.name = name
        sp.start_time_unix_nano = now if start is None else start
        sp.end_time_unix_nano = (now + 1000) if end is None else end
        for a in range(n_attrs):
            kv = sp.attributes.add()
            kv.key, kv.value.int_value = f"k{a}", a
    return req


def _request(resource: dict[str, str], scope: tuple[str, str] = ("", "")):
    """An empty request with one resource and one scope: (request, its ScopeSpans)."""
    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    _attrs(rs.resource.attributes, resource)
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = scope
    return req, ss


def _attrs(kvs, values: dict) -> None:
    for k, v in values.items():
        kv = kvs.add()
        kv.key = k
        if isinstance(v, int):
            kv.value.int_value = v
        else:
            kv.value.string_value = v


def plugin_like_request(n_spans: int, seed: int, t0: int | None = None) -> bytes:
    """Request trees of 6 spans with the plugin's attributes (the benchmarks' load)."""
    rng = random.Random(seed)
    req, ss = _request({ResourceAttr.SERVICE_NAME: "vllm-api", ResourceAttr.SERVICE_VERSION: "0.32.0",
                        ResourceAttr.HOST_NAME: "node-1", ResourceAttr.ROLE: "api_server",
                        ResourceAttr.RUN: "bench", "telemetry.sdk.language": "python"}, ("ttftscope", "0.1.0"))
    t = t0 or time.time_ns()
    names = [SpanName.REQUEST, SpanName.TOKENIZE, SpanName.QUEUE, SpanName.PREFILL, SpanName.PREFILL, SpanName.OUTPUT]
    trace_id = root = b""
    for i in range(n_spans):
        if i % 6 == 0:
            trace_id, root = os.urandom(16), os.urandom(8)
        sp = ss.spans.add()
        sp.trace_id = trace_id
        sp.span_id = root if i % 6 == 0 else os.urandom(8)
        if i % 6:
            sp.parent_span_id = root
        sp.name = names[i % 6]
        sp.kind = 2 if i % 6 == 0 else 1
        sp.start_time_unix_nano = t + i * 1000
        sp.end_time_unix_nano = t + i * 1000 + rng.randint(10_000, 50_000_000)
        _attrs(sp.attributes, {Attr.REQUEST_ID: f"cmpl-{seed}-{i // 6}", Attr.STEP: rng.randint(1, 10**6),
                               Attr.TOKENS_COMPUTED: rng.randint(1, 4096), Attr.TOKENS_CACHED: rng.randint(0, 512),
                               Attr.BATCH_SIZE: rng.randint(1, 64), Attr.PHASE: "prefill"})
        sp.status.code = 1
    return req.SerializeToString()


def numbered_batch(batch_no: int, n: int, service: str = "dur") -> bytes:
    """A request whose span ids encode (batch, index), so each span is identifiable."""
    return otlp_request(n, name="dur", service=service,
                        ids=lambda i: (batch_no + 1, (batch_no << 16) + i + 1)).SerializeToString()


def numbered_ids(batch_no: int, n: int) -> set[str]:
    """The span ids (hex) of :func:`numbered_batch`."""
    return {format((batch_no << 16) + i + 1, "016x") for i in range(n)}


class Sender(threading.Thread):
    """Sends numbered batches until stopped; remembers exactly which spans were acknowledged."""

    def __init__(self, url: str, per_batch: int = 50, start_at: int = 0) -> None:
        super().__init__(daemon=True)
        self.url, self.per_batch, self.next = url, per_batch, start_at
        self.acked: set[str] = set()
        self.refused = 0
        self.stop = threading.Event()

    def run(self) -> None:
        s = requests.Session()
        while not self.stop.is_set():
            b = self.next
            self.next += 1
            try:
                r = s.post(self.url + "/v1/traces", data=numbered_batch(b, self.per_batch), headers=PB, timeout=10)
            except requests.RequestException:
                continue  # the collector died mid-request: not acknowledged
            if r.status_code == 200:
                self.acked |= numbered_ids(b, self.per_batch)
            else:
                self.refused += 1
