"""Send spans with the stock OpenTelemetry Python SDK and keep the SDK's own record of them."""

from __future__ import annotations

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
