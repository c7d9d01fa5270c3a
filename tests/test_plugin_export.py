"""The plugin's export path without vLLM: deferred span tuples encoded straight to OTLP
protobuf and SDK spans (vLLM's own) share one request into a real collector, with the
trace/parent ids, attribute types and resource the plugin gave them."""

from __future__ import annotations

import pytest
from conftest import ttftscope_sql
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from ttftscope.collector import span_wire as W
from ttftscope.collector.otel_setup import BoundedBatchSpanProcessor, DeferredSpans
from ttftscope.collector.span_wire import OtlpHttpPoster


def test_sdk_spans_written_directly_are_the_sdk_encoders_message():
    """vLLM's own spans (SDK ``ReadableSpan``s) written by ``span_wire.sdk_request`` parse into
    exactly the message the SDK's OTLP encoder builds: kinds, remote and local parents, trace
    state, status with and without a description, every scalar value type, two resources and
    two scopes (one with a schema URL), a span with no scope; a span with an event, a link or an
    array value is left to the SDK's encoder (None)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.trace import (
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        Status,
        StatusCode,
        TraceFlags,
        TraceState,
    )

    ended = []

    class Keep(SpanProcessor):
        def on_end(self, span):
            ended.append(span)

    def provider(attrs: dict, schema_url: str = "") -> TracerProvider:
        p = TracerProvider(resource=Resource(attrs, schema_url))
        p.add_span_processor(Keep())
        return p

    a = provider({"service.name": "vllm", "vllm.process_id": "42", "n": 3}, "https://opentelemetry.io/schemas/1.21.0")
    b = provider({"service.name": "other", "ok": True})
    remote = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, is_remote=True, trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1"), ("k", "x")]))))
    vllm = a.get_tracer("vllm.entrypoints", "0.32.0", schema_url="https://example.com/s")
    req = vllm.start_span("llm_request", context=remote, kind=SpanKind.SERVER, start_time=1_700_000_000_000_000_001,
                          attributes={"gen_ai.usage.prompt_tokens": 130, "gen_ai.latency.time_in_queue": 0.0123,
                                      "gen_ai.request.id": "cmpl-é" * 3, "gen_ai.request.top_p": 1.0,
                                      "neg": -7, "big": 2**62, "flag": False, "long": "x" * 300})
    child = vllm.start_span("child", context=trace.set_span_in_context(req), kind=SpanKind.CLIENT)
    child.set_status(Status(StatusCode.ERROR, "engine dead"))
    child.end(end_time=1_700_000_000_500_000_000)
    req.set_status(Status(StatusCode.OK))
    req.end(end_time=1_700_000_001_000_000_000)
    root = b.get_tracer("").start_span("process", kind=SpanKind.INTERNAL)  # no scope name or version
    root.end()
    other = a.get_tracer("ttftscope.vllm").start_span("step", kind=SpanKind.PRODUCER, attributes={"x": 1})
    other.end()
    spans = list(ended)
    mine = W.sdk_request(spans)
    assert mine is not None
    assert ExportTraceServiceRequest.FromString(mine) == encode_spans(spans)
    assert ExportTraceServiceRequest.FromString(mine + W.sdk_request(spans[:1])) == ExportTraceServiceRequest(
        resource_spans=[*encode_spans(spans).resource_spans, *encode_spans(spans[:1]).resource_spans])

    tracer = a.get_tracer("t")
    with_event = tracer.start_span("e")
    with_event.add_event("boom")
    with_event.end()
    array = tracer.start_span("a", attributes={"ids": (1, 2, 3)})
    array.end()
    linked = tracer.start_span("l", links=[trace.Link(req.get_span_context())])
    linked.end()
    for s in ended[-3:]:
        assert isinstance(s, ReadableSpan) and W.sdk_request([*spans, s]) is None, s.name


@pytest.mark.parametrize("transport", ["poster", "poster-gzip", "sdk-client"])
def test_deferred_and_sdk_spans_arrive_intact(collector_factory, transport):
    """Through the plugin's own poster (http.client; gzip from OTEL_EXPORTER_OTLP_COMPRESSION)
    and through the stock exporter's client."""
    col = collector_factory().start()
    resource = Resource.create({"service.name": "plugin-export", "ttftscope.process.role": "engine_core"})
    provider = TracerProvider(resource=resource)
    env = {"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"} if transport == "poster-gzip" else {}
    poster = OtlpHttpPoster(col.url + "/v1/traces", timeout=5, env=env) if transport != "sdk-client" else None
    proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=col.url + "/v1/traces", timeout=5), interval_s=60,
                                     poster=poster)
    provider.add_span_processor(proc)
    tracer = provider.get_tracer("t")
    deferred = DeferredSpans(tracer, resource, max_queue=5)
    proc.add_source(deferred)

    tid, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    deferred.add("ttftscope.prefill", 1_700_000_000.25, 1_700_000_000.5,
                 {"gen_ai.request.id": "r1", "ttftscope.step": 7, "ratio": 0.5, "flag": True},
                 {"traceparent": f"00-{tid}-{parent}-01"})
    root = tracer.start_span("ttftscope.process", start_time=1_700_000_000 * 10**9)  # an SDK span, like vLLM's
    deferred.add("ttftscope.load", 1_700_000_000.0, 1_700_000_000.1, {"ttftscope.load.stage": "imports"},
                 trace.set_span_in_context(root))
    root.end(end_time=1_700_000_001 * 10**9)
    deferred.add("ttftscope.step", 1_700_000_002.0, 1_700_000_001.0, {"ttftscope.step": 8})  # end < start: clamped
    deferred.add("ttftscope.tokenize", 1_700_000_002.0, 1_700_000_002.1, {"x": 1},
                 {"traceparent": "00-" + "z" * 32 + "-" + "y" * 16 + "-01"})  # a client's malformed header
    for i in range(5):  # the queue holds 5: one of these fits, four are dropped and counted
        deferred.add("ttftscope.queue", 1_700_000_003.0, 1_700_000_003.1, {"i": i})
    assert deferred.dropped == 4
    assert proc.force_flush() and proc.exported == 6 and proc.failed == 0
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0

    rows = {r["SpanName"]: r for r in ttftscope_sql(col.store, """
        SELECT SpanName, TraceId, ParentSpanId, SpanId, toUnixTimestamp64Nano(Timestamp) AS start, Duration,
               SpanAttributes AS a, ResourceAttributes AS res, ScopeName
        FROM otel_traces WHERE ServiceName = 'plugin-export' AND SpanName != 'ttftscope.queue'""")}
    p = rows["ttftscope.prefill"]
    assert (p["TraceId"], p["ParentSpanId"]) == (tid, parent), "the request's traceparent is continued"
    # float seconds carry ~0.25 us at this magnitude
    assert abs(int(p["start"]) - 1_700_000_000_250_000_000) < 1000 and abs(int(p["Duration"]) - 250_000_000) < 1000
    assert p["a"] == {"gen_ai.request.id": "r1", "ttftscope.step": "7", "ratio": "0.5", "flag": "true"}
    assert p["res"]["ttftscope.process.role"] == "engine_core" and p["ScopeName"] == "ttftscope.vllm"
    load, proc_span = rows["ttftscope.load"], rows["ttftscope.process"]
    assert load["TraceId"] == proc_span["TraceId"] and load["ParentSpanId"] == proc_span["SpanId"]
    step = rows["ttftscope.step"]
    assert step["ParentSpanId"] == "" and len(step["TraceId"]) == 32 and int(step["Duration"]) == 0
    tok = rows["ttftscope.tokenize"]
    assert tok["ParentSpanId"] == "" and len(tok["TraceId"]) == 32, "a malformed traceparent starts a new trace"
    n = ttftscope_sql(col.store, "SELECT count() AS n FROM otel_traces WHERE SpanName = 'ttftscope.queue'")[0]["n"]
    assert int(n) == 1


def test_with_another_exporter_deferred_spans_become_sdk_spans():
    """An exporter that is not the stock OTLP/HTTP one gets SDK spans built from the tuples."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "plugin-export"}))
    proc = BoundedBatchSpanProcessor(memory, interval_s=60)
    provider.add_span_processor(proc)
    deferred = DeferredSpans(provider.get_tracer("t"))
    proc.add_source(deferred)
    tid, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    deferred.add("ttftscope.queue", 1_700_000_000.0, 1_700_000_000.5, {"gen_ai.request.id": "r9"},
                 {"traceparent": f"00-{tid}-{parent}-01"})
    assert proc.force_flush()
    (span,) = memory.get_finished_spans()
    assert span.name == "ttftscope.queue" and dict(span.attributes) == {"gen_ai.request.id": "r9"}
    assert format(span.context.trace_id, "032x") == tid and format(span.parent.span_id, "016x") == parent
    assert span.end_time - span.start_time == 500_000_000


def test_wire_encoding_is_the_otlp_schema():
    """The plugin's hand-written protobuf parses, with the official OTLP classes, into exactly
    the message those classes build: every value type, long and non-ASCII strings, negative
    and 64-bit ints, None left out; and it joins an SDK-serialized request by concatenation."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    tid, sid, pid = bytes(range(16)), bytes(range(8, 16)), bytes(range(100, 108))
    attrs = {"s": "é" * 70, "long": "x" * 300, "small": 5, "zero": 0, "big": 2**40, "neg": -3, "f": 0.25,
             "t": True, "fa": False, "none": None, "other": [1, 2]}
    values = {"s": AnyValue(string_value="é" * 70), "long": AnyValue(string_value="x" * 300),
              "small": AnyValue(int_value=5), "zero": AnyValue(int_value=0), "big": AnyValue(int_value=2**40),
              "neg": AnyValue(int_value=-3), "f": AnyValue(double_value=0.25), "t": AnyValue(bool_value=True),
              "fa": AnyValue(bool_value=False), "other": AnyValue(string_value="[1, 2]")}
    start, end = 1_700_000_000_123_456_789, 1_700_000_000_223_456_789
    rs = W.resource_spans({"service.name": "svc", "pid": 42}, ("scope", "1.0"),
                          [W.span(tid, sid, pid, "k=v", "ttftscope.prefill", start, end, attrs),
                           W.span(tid, sid, b"", "", "n" * 200, start, start, {})])
    expected = ResourceSpans(
        resource=PbResource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value="svc")),
                                        KeyValue(key="pid", value=AnyValue(int_value=42))]),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name="scope", version="1.0"), spans=[
            Span(trace_id=tid, span_id=sid, parent_span_id=pid, trace_state="k=v", name="ttftscope.prefill",
                 kind=Span.SPAN_KIND_INTERNAL, start_time_unix_nano=start, end_time_unix_nano=end,
                 attributes=[KeyValue(key=k, value=v) for k, v in values.items()]),
            Span(trace_id=tid, span_id=sid, name="n" * 200, kind=Span.SPAN_KIND_INTERNAL,
                 start_time_unix_nano=start, end_time_unix_nano=start)])])
    assert ResourceSpans.FromString(rs) == expected
    joined = ExportTraceServiceRequest(resource_spans=[expected]).SerializeToString() + W.request_entry(rs)
    assert list(ExportTraceServiceRequest.FromString(joined).resource_spans) == [expected, expected]


def test_wire_varints_at_every_length_boundary():
    """Ints and string lengths on both sides of each varint length (1 to 5 bytes, and past the
    unrolled ones) parse, with the official classes, into the values written."""
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    edges = [0, 1, 127, 128, 129, 16383, 16384, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**35, 2**63 - 1]
    attrs = {f"i{n}": n for n in edges}
    attrs |= {f"s{n}": "v" * n for n in (127, 128, 16383, 16384, 2**21 + 5)}
    raw = W.span(bytes(16), bytes(range(1, 9)), bytes(range(9, 17)), "", "n", 5, 2**40, attrs)
    got = Span.FromString(raw)
    values = {kv.key: kv.value.int_value if kv.value.HasField("int_value") else kv.value.string_value
              for kv in got.attributes}
    assert values == attrs
    assert (got.span_id, got.parent_span_id, got.end_time_unix_nano) == (bytes(range(1, 9)), bytes(range(9, 17)), 2**40)


def test_remembered_attribute_pairs_encode_as_the_first_time():
    """Small ints and short strings are written once per (key, value) and then reused: the
    same attributes encoded again (from what was remembered) and in any mix of types that
    compare equal in Python (1, True, 1.0, "1") parse into the official message every time,
    under both the span's and the resource's field tags."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource as PbResource
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    def official(attrs: dict) -> list:
        def value(v):
            if isinstance(v, bool):
                return AnyValue(bool_value=v)
            if isinstance(v, int):
                return AnyValue(int_value=v)
            if isinstance(v, float):
                return AnyValue(double_value=v)
            return AnyValue(string_value=v)
        return [KeyValue(key=k, value=value(v)) for k, v in attrs.items()]

    mixes = [{"k": 1, "phase": "queue", "e": "", "u": "é" * 8, "n": 1023, "m": 1024},
             {"k": True, "phase": "prefill", "e": "", "u": "é" * 9, "n": 1023, "m": 1024},
             {"k": 1.0, "phase": "queue", "e": "x" * 17, "u": "é" * 8, "n": 0, "m": 1024},
             {"k": "1", "phase": "q" * 16, "e": "", "u": "é" * 8, "n": 1023, "m": 2**40}]
    for _ in range(2):  # the second round reads back what the first remembered
        for attrs in mixes:
            raw = W.span(bytes(16), bytes(range(1, 9)), b"", "", "n", 5, 6, attrs)
            assert list(Span.FromString(raw).attributes) == official(attrs)
            assert list(PbResource.FromString(W.key_values(b"\x0a", attrs)).attributes) == official(attrs)


def test_spans_of_one_batch_keep_each_requests_trace_headers():
    """A batch where requests' spans share their trace headers (one dict per request), one
    request's header is malformed and one span has none: each span continues its own request's
    trace, the malformed and the missing ones start traces of their own."""
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans

    a = {"traceparent": "00-" + "a1" * 16 + "-" + "b1" * 8 + "-01", "tracestate": "k=v"}
    b = {"traceparent": "00-" + "a2" * 16 + "-" + "b2" * 8 + "-01"}
    bad = {"traceparent": "00-" + "zz" * 16 + "-" + "b3" * 8 + "-01"}
    d = DeferredSpans(None, Resource.create({"service.name": "t"}))
    rs = ResourceSpans.FromString(d.encode([("qa", 1.0, 2.0, {}, a), ("qb", 1.0, 2.0, {}, b), ("pa", 1.0, 2.0, {}, a),
                                            ("x", 1.0, 2.0, {}, bad), ("pb", 1.0, 2.0, {}, dict(b)),
                                            ("none", 1.0, 2.0, {}, None)]))
    spans = {s.name: s for s in rs.scope_spans[0].spans}
    for name, h in (("qa", a), ("pa", a), ("qb", b), ("pb", b)):
        tp = h["traceparent"]
        assert (spans[name].trace_id.hex(), spans[name].parent_span_id.hex()) == (tp[3:35], tp[36:52]), name
    assert spans["qa"].trace_state == spans["pa"].trace_state == "k=v" and spans["qb"].trace_state == ""
    for name in ("x", "none"):
        assert not spans[name].parent_span_id and spans[name].trace_id not in (spans["qa"].trace_id, spans["qb"].trace_id)
    assert spans["x"].trace_id != spans["none"].trace_id
    assert len({s.span_id for s in spans.values()}) == 6


def test_poster_reports_refusals_and_a_dead_collector_without_raising(collector_factory):
    from ttftscope.collector.span_wire import parse_headers

    assert parse_headers("Authorization=Bearer%20x, a=b=c ,bad") == {"authorization": "Bearer x", "a": "b=c"}
    col = collector_factory().start()
    p = OtlpHttpPoster(col.url + "/v1/traces", timeout=2)
    assert p.export(b"") and p.last_status == 200  # an empty request is valid OTLP
    assert not p.export(b"\xff\xff") and p.last_status == 400
    assert col.terminate() == 0
    assert not p.export(b""), "the collector is gone: False, no exception"
    with pytest.raises(ValueError):
        OtlpHttpPoster("localhost:4318")


def test_poster_never_sends_a_request_twice_after_a_timeout():
    """A collector slower than the export timeout may still store the spans: the poster gives
    up (False) instead of sending them again (which stored every such batch twice), and a
    kept-alive connection the server closed is retried once on a fresh one."""
    import time

    from support.http_stub import PostSink

    with PostSink(keep_alive=True) as sink:
        p = OtlpHttpPoster(sink.url + "/v1/traces", timeout=0.3)
        assert p.export(b"")  # a kept-alive connection now
        sink.delay_s = 1.0
        assert p.export(b"") is False
        time.sleep(2.5)
        assert len(sink.seen) == 2, "sent once, not again on a fresh connection after the timeout"
        sink.delay_s = 0.0
        sink.seen.clear()
        p = OtlpHttpPoster(sink.url + "/v1/traces", timeout=2)
        assert p.export(b"") and p.export(b"") and [path for path, _ in sink.seen] == ["/v1/traces", "/v1/traces"], \
            "one kept-alive connection"
        p._conn.sock.shutdown(2)  # the server side goes away between two exports (as an idle timeout would)
        assert p.export(b"") and len(sink.seen) == 3, "a fresh connection, the request sent once"


def test_batches_encoded_in_slices_arrive_whole(collector_factory, monkeypatch):
    """The export thread gives the GIL away as it encodes, by time (so vLLM's engine loop or
    API server does not wait 5 ms behind it): between SDK spans (vLLM's own, ~3x the cost of
    ours) as between deferred ones (ours). A batch encoded with many such breaks is still one
    request, every span exactly once."""
    from ttftscope.collector import otel_setup

    made = []

    class EverySpan(otel_setup.GilYield):  # every tick is due: count where the breaks fall
        def __init__(self, every_s=None):
            super().__init__(1e-9)
            made.append(self)

    monkeypatch.setattr(otel_setup, "GilYield", EverySpan)
    col = collector_factory().start()
    resource = Resource.create({"service.name": "sliced"})
    provider = TracerProvider(resource=resource)
    proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=col.url + "/v1/traces", timeout=5), interval_s=60,
                                     poster=OtlpHttpPoster(col.url + "/v1/traces", timeout=5))
    provider.add_span_processor(proc)
    tracer = provider.get_tracer("t")
    deferred = DeferredSpans(tracer, resource)
    proc.add_source(deferred)
    n = 163
    for i in range(n):
        tracer.start_span("sdk", attributes={"i": i}).end()
        deferred.add("ours", 1_700_000_000.0 + i, 1_700_000_000.5 + i, {"i": i})
    assert proc.force_flush() and proc.exported == 2 * n and proc.failed == 0
    assert sum(y.yields for y in made) >= 2 * n - 2, "the GIL given away between SDK spans and between ours"
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    rows = ttftscope_sql(col.store, "SELECT SpanName AS name, count() AS n, uniqExact(SpanAttributes['i']) AS u, "
                                    "uniqExact(SpanId) AS ids FROM otel_traces WHERE ServiceName = 'sliced' GROUP BY name")
    assert {r["name"]: (int(r["n"]), int(r["u"]), int(r["ids"])) for r in rows} == {"sdk": (n, n, n), "ours": (n, n, n)}


def test_spans_the_collector_refuses_are_sent_again_once_it_accepts(collector_factory):
    """A collector that refuses a batch with a retryable status (here 429 with Retry-After: its
    spool is over ``--max-spool`` until its next flush) stored none of it: the batch goes back to
    the front of the queue and is sent again once the collector accepts. Every span arrives
    exactly once; nothing is counted as failed."""
    import time

    # (flushes 3 s apart: the two batches, milliseconds apart, meet the same unflushed spool)
    col = collector_factory(extra=["--max-spool", "1"], flush_interval=3.0).start()
    resource = Resource.create({"service.name": "refused"})
    provider = TracerProvider(resource=resource)
    poster = OtlpHttpPoster(col.url + "/v1/traces", timeout=5)
    proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=col.url + "/v1/traces", timeout=5),
                                     interval_s=60, max_batch=4, poster=poster)
    provider.add_span_processor(proc)
    tracer = provider.get_tracer("t")
    deferred = DeferredSpans(tracer, resource)
    proc.add_source(deferred)
    tracer.start_span("sdk", attributes={"i": 0}).end()
    for i in range(6):
        deferred.add("ours", 1_700_000_000.0 + i, 1_700_000_000.5 + i, {"i": i})
    # the first batch (4 spans) fills the spool; the second (3) meets it full, until the next flush
    assert not proc.force_flush(), "the second batch was refused"
    assert poster.last_status == 429 and poster.retry_after == "1", (poster.last_status, poster.retry_after)
    assert (proc.exported, proc.failed, proc.retried, len(deferred)) == (4, 0, 3, 3), \
        "the refused batch is queued again, whole"
    deadline = time.monotonic() + 30
    while not proc.force_flush() and time.monotonic() < deadline:  # the collector flushes its spool
        time.sleep(0.2)
    assert (proc.exported, proc.failed) == (7, 0), (proc.exported, proc.failed, poster.last_status)
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    rows = ttftscope_sql(col.store, "SELECT SpanName AS name, SpanAttributes['i'] AS i, count() AS n FROM otel_traces "
                                    "WHERE ServiceName = 'refused' GROUP BY name, i ORDER BY name, i")
    assert [(r["name"], r["i"], int(r["n"])) for r in rows] == [("ours", str(i), 1) for i in range(6)] + [("sdk", "0", 1)]


def test_a_wake_up_posts_what_was_queued_not_what_arrives_while_it_posts(collector_factory):
    """A serving process adds spans all the time: the export thread, woken by its interval,
    posts what was queued then, every source's spans in one request, and leaves what arrives
    meanwhile for the next wake-up. (A drain that chased the arrivals, a request per source,
    posted about once per served request: 69 posts for 60 requests in 5.7 s in vLLM's API server
    at a 2-s interval.) A flush still sends everything, each span once."""
    import threading
    import time

    col = collector_factory().start()
    resource = Resource.create({"service.name": "one-wake"})
    proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=col.url + "/v1/traces", timeout=5), interval_s=60,
                                     poster=OtlpHttpPoster(col.url + "/v1/traces", timeout=5))
    deferred = DeferredSpans(None, resource)
    proc.add_source(deferred)
    vllms = DeferredSpans(None, resource, scope=("vllm.tracing.otel", ""))  # a second source (vLLM's spans)
    proc.add_source(vllms)
    for i in range(20):
        deferred.add("queued", 1_700_000_000.0 + i, 1_700_000_000.5 + i, {"i": i})
    for i in range(5):
        vllms.add("llm_request", 1_700_000_000.0 + i, 1_700_000_000.5 + i, {"i": i})
    arriving = threading.Event()

    def arrivals() -> None:  # a span a millisecond for 0.4 s (fewer than a batch: no wake-up of their own)
        arriving.set()
        for i in range(400):
            deferred.add("arrived", 1_700_000_100.0 + i, 1_700_000_100.5 + i, {"i": i})
            time.sleep(0.001)

    t = threading.Thread(target=arrivals)
    t.start()
    arriving.wait()
    proc._drain()  # what the export thread does when its interval is up
    posted_while_arriving, exported = proc.posts, proc.exported
    t.join()
    # one post: the 25 queued (and the odd span that arrived before it began), not the 400 arriving
    assert posted_while_arriving == 1 and 25 <= exported < 45, (posted_while_arriving, exported)
    assert proc.force_flush() and proc.exported == 425 and proc.failed == 0
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    rows = ttftscope_sql(col.store, "SELECT SpanName AS name, count() AS n, uniqExact(SpanAttributes['i']) AS u "
                                    "FROM otel_traces WHERE ServiceName = 'one-wake' GROUP BY name")
    assert {r["name"]: (int(r["n"]), int(r["u"])) for r in rows} == {"queued": (20, 20), "arrived": (400, 400),
                                                                      "llm_request": (5, 5)}


def test_a_flush_waits_for_the_export_in_flight(collector_factory):
    """A flush while the export thread is posting (woken by a full batch) returns once that post
    is answered, not at once because the queue is empty: what ended before the flush was exported
    (or counted failed) when it returns, as the OpenTelemetry SDK's processor does. (CI caught the
    sidecar test of a stopped sidecar reading ``failed == 0`` after its flush: the export thread
    had taken the 512 spans and was still waiting on the pipe.)"""
    import os
    import signal
    import threading
    import time

    col = collector_factory().start()
    proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=col.url + "/v1/traces", timeout=10), interval_s=60,
                                     max_batch=8, poster=OtlpHttpPoster(col.url + "/v1/traces", timeout=10))
    deferred = DeferredSpans(None, Resource.create({"service.name": "in-flight"}), max_batch=8)
    proc.add_source(deferred)
    resume = threading.Timer(0, lambda: None)
    os.kill(col.proc.pid, signal.SIGSTOP)  # the collector takes the request but answers only when resumed
    try:
        for i in range(8):  # a full batch: the export thread wakes and posts it
            deferred.add("full", 1_700_000_000.0 + i, 1_700_000_000.5 + i, {"i": i})
        deadline = time.monotonic() + 10
        while len(deferred) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(deferred) == 0  # taken by the export thread, which now waits for the answer
        resume = threading.Timer(1.0, os.kill, (col.proc.pid, signal.SIGCONT))
        resume.start()
        assert proc.force_flush() and proc.exported == 8, proc.exported
    finally:
        resume.cancel()
        os.kill(col.proc.pid, signal.SIGCONT)
    proc.shutdown()
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    assert ttftscope_sql(col.store, "SELECT count() AS n FROM otel_traces WHERE ServiceName = 'in-flight'")[0]["n"] == 8


def test_a_child_forked_mid_export_can_still_flush_and_exit():
    """A fork while the export thread posts (its drain lock held) must not leave the child's copy
    of the lock held: the child's flush, and its exit, would wait for ever. (vLLM starts its
    engine core and workers as multiprocessing children.) Also the sidecar's send lock."""
    import os

    from ttftscope.collector.handoff import HandoffProcessor

    p = BoundedBatchSpanProcessor(None, interval_s=60)
    h = HandoffProcessor(None, role="t", endpoint="http://127.0.0.1:9/v1/traces", timeout_s=1, interval_s=60)
    for proc, held in ((p, p._drain_lock), (h, h._drain_lock), (h, h.link.lock)):
        held.acquire()  # as the export thread holds it while it posts
        pid = os.fork()
        if pid == 0:  # the child: its flush (nothing queued) and the sidecar's send lock
            ok = proc.force_flush(timeout_millis=2000) and (proc is not h or h.link.lock.acquire(timeout=2))
            os._exit(0 if ok else 1)
        held.release()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (type(proc).__name__, held)
    p.shutdown()
    h.shutdown()


def test_a_driven_export_thread_leaves_the_interval_to_the_thread_that_drives_it():
    """The engine core's step-flush thread wakes every second anyway: while it drives the export
    (``drive``; only where the spans go to an export sidecar), the export thread wakes only for a
    full batch or a flush, and what is queued goes when the driving thread calls ``export_due``,
    which never doubles a post. ``drive(False)`` gives the interval back to the export thread."""
    import time

    from support.http_stub import PostSink

    with PostSink() as sink:
        proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=sink.url + "/v1/traces", timeout=5), interval_s=0.1,
                                         poster=OtlpHttpPoster(sink.url + "/v1/traces", timeout=5))
        src = DeferredSpans(None, Resource.create({"service.name": "driven"}), max_batch=8)
        proc.add_source(src)
        proc.drive(True)
        for i in range(3):
            src.add("queued", 1_700_000_000.0 + i, 1_700_000_000.5 + i, {"i": i})
        time.sleep(0.6)  # six of the export thread's intervals
        assert proc.posts == 0, "the export thread left the interval to the driving thread"
        assert proc.export_due() > 0 and (proc.posts, proc.exported) == (1, 3)
        proc.export_due()
        assert proc.posts == 1, "nothing queued: no post"

        def exported(n: int) -> bool:
            deadline = time.monotonic() + 10
            while proc.exported < n and time.monotonic() < deadline:
                time.sleep(0.02)
            return proc.exported == n

        for i in range(8):  # a full batch wakes the export thread itself
            src.add("batch", 1_700_000_010.0 + i, 1_700_000_010.5 + i, {"i": i})
        assert exported(11), proc.exported
        proc.drive(False)
        src.add("interval", 1_700_000_020.0, 1_700_000_020.5, {"i": 0})
        assert exported(12), "the export thread's own interval again"
        proc.shutdown()
    assert sum(body.count(b"queued") for _, body in sink.seen) == 3
