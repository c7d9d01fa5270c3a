"""Send spans with the stock OpenTelemetry Python SDK and keep the SDK's own record of them;
build raw OTLP requests for the tests that need exact bytes."""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags


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
    tp = TracerProvider(resource=Resource.create({"service.name": service, "service.version": "9.9.9",
                                                  "host.name": "h1", "ttftscope.run": "test"}))
    tp.add_span_processor(SimpleSpanProcessor(memory))
    tp.add_span_processor(BatchSpanProcessor(make_exporter(endpoint, encoding, **exporter_kw),
                                             schedule_delay_millis=100))
    tr = tp.get_tracer("ttftscope.tests", "1.2.3")
    foreign = SpanContext(trace_id=0xABCDEF0123456789ABCDEF0123456789, span_id=0x1122334455667788,
                          is_remote=True, trace_flags=TraceFlags(1))
    for i in range(n):
        with tr.start_as_current_span(
            "llm_request", kind=SpanKind.SERVER,
            attributes={"gen_ai.request.id": f"req-{i}", "i": i, "ratio": 0.25 + i, "flag": i % 2 == 0,
                        "tags": ["a", "b"], "ints": [1, 2, 3], "unicode": "héllo ✓"},
            links=[Link(foreign, {"link.kind": "follows"})],
        ) as root:
            root.add_event("first_token", {"tokens": 3, "where": "api"})
            with tr.start_as_current_span("ttftscope.queue", kind=SpanKind.INTERNAL) as q:
                q.set_attribute("ttftscope.scheduler.waiting", i)
            with tr.start_as_current_span("ttftscope.prefill", kind=SpanKind.CLIENT) as p:
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
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    req = trace_service_pb2.ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", service
    ss = rs.scope_spans.add()
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
