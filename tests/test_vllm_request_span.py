"""vLLM's own ``llm_request`` span, recorded by the plugin instead of built as an SDK span on
the API server's event loop (the ``vllm-request-span`` adapter): the same OTLP span as the
OpenTelemetry SDK's own encoder writes for vLLM's call (the witness), the SDK's sampling kept,
and what it does not take left to vLLM's backend. vLLM's real ``instrument_manual`` with the
arguments its output processor passes; in a subprocess (the global tracer provider is set once
per process)."""

from __future__ import annotations

import json
import subprocess

from conftest import PY, ROOT

SCRIPT = r'''
import json, os, time
os.environ["TTFTSCOPE_ENDPOINT"] = "http://127.0.0.1:9/v1/traces"
import vllm.tracing as vt
from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.trace import SpanKind
from ttftscope.collector import span_wire
from ttftscope.collector.vllm_plugin import vllm_tracing
from ttftscope.collector.vllm_plugin.runtime import RT, setup_otel
from vllm.tracing.otel import extract_trace_context

setup_otel("api_server")
proc = RT.processor
proc._stop.set(); proc._wake.set(); proc._t.join()  # no export thread: the test takes the queues
sdk = vt._REGISTERED_TRACING_BACKENDS["otel"]
vllm_tracing._install_request_span()
ours = vt._REGISTERED_TRACING_BACKENDS["otel"]
headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"}
attrs = {"gen_ai.latency.time_to_first_token": 0.0123, "gen_ai.usage.prompt_tokens": 123,
         "gen_ai.request.id": "cmpl-1", "gen_ai.request.top_p": 1.0, "gen_ai.request.n": 1}
start = time.time_ns() - 50_000_000

def call(backend, ctx_headers=headers, kind=SpanKind.SERVER, end=None):
    vt._REGISTERED_TRACING_BACKENDS["otel"] = backend
    ctx = extract_trace_context(ctx_headers) if ctx_headers is not None else None
    vt.instrument_manual("llm_request", start, end, dict(attrs), ctx, kind)

def sdk_spans():
    out = [proc._q.popleft() for _ in range(len(proc._q))]
    return MessageToDict(encode_spans(out)) if out else {}

def our_spans():
    recs = RT.vllm_spans.take(10**6)
    if not recs:
        return {}
    r = trace_service_pb2.ExportTraceServiceRequest()
    r.ParseFromString(span_wire.request_entry(RT.vllm_spans.encode(recs)))
    return MessageToDict(r)

res = {}
call(sdk); res["sdk"] = sdk_spans(); res["sdk_left_for_ours"] = len(RT.vllm_spans)
call(ours); res["ours"] = our_spans(); res["ours_left_in_sdk"] = len(proc._q)
call(ours, end=start + 7_000_000); res["ours_end"] = our_spans()
unsampled = {"traceparent": headers["traceparent"][:-2] + "00"}
call(sdk, unsampled); res["sdk_unsampled"] = len(proc._q)
call(ours, unsampled); res["ours_unsampled"] = (len(proc._q), len(RT.vllm_spans))
call(ours, None); res["no_context"] = (len(proc._q), len(RT.vllm_spans)); sdk_spans()
call(ours, kind=SpanKind.INTERNAL); res["internal"] = (len(proc._q), len(RT.vllm_spans))
sdk_spans()
call(ours); RT.vllm_spans.materialize(); res["materialized"] = sdk_spans()  # for an exporter of SDK spans
import logging
logs = []
class Logs(logging.Handler):
    def emit(self, record):
        logs.append(record.getMessage())
logging.getLogger("vllm.ttftscope").addHandler(Logs())
def boom(*a, **kw):
    raise RuntimeError("boom")
RT.vllm_spans.add = boom  # the hook fails (hot: no guard of its own; the backend's wrapper catches)
for _ in range(3):
    call(ours)
res["broken"] = (len(proc._q), sum("llm_request failed and is now disabled" in m for m in logs))
print(json.dumps(res))
'''


def _span(doc: dict) -> tuple[dict, dict, dict]:
    (rs,) = doc["resourceSpans"]
    (ss,) = rs["scopeSpans"]
    (sp,) = ss["spans"]
    return rs["resource"], ss["scope"], sp


def test_vllms_request_span_is_the_sdks_span_without_the_sdk():
    r = subprocess.run([PY, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["sdk_left_for_ours"] == 0 and res["ours_left_in_sdk"] == 0, "each call went one way only"
    (sdk_res, sdk_scope, want), (our_res, our_scope, got) = _span(res["sdk"]), _span(res["ours"])
    # the span as the SDK's own encoder writes vLLM's call: ids, parent, state, name, kind, attributes
    for k in ("traceId", "parentSpanId", "traceState", "name", "kind"):
        assert got.get(k) == want.get(k), (k, got.get(k), want.get(k))
    assert want["kind"] == "SPAN_KIND_SERVER" and want["parentSpanId"]
    key = lambda kvs: sorted(kvs, key=lambda kv: kv["key"])  # noqa: E731
    assert key(got["attributes"]) == key(want["attributes"])
    assert abs(int(got["startTimeUnixNano"]) - int(want["startTimeUnixNano"])) <= 1_000, "the request's arrival"
    assert int(got["endTimeUnixNano"]) >= int(got["startTimeUnixNano"])
    (_, _, ended) = _span(res["ours_end"])
    assert abs(int(ended["endTimeUnixNano"]) - int(ended["startTimeUnixNano"]) - 7_000_000) <= 1_000, "vLLM's end"
    assert our_scope["name"] == sdk_scope["name"] == "vllm.tracing.otel"
    assert key(our_res["attributes"]) == key(sdk_res["attributes"]), "the process's resource"
    # the SDK's parent-based sampling: an unsampled request leaves nothing, either way
    assert res["sdk_unsampled"] == 0 and res["ours_unsampled"] == [0, 0]
    # what it does not take goes to vLLM's own backend (the SDK)
    assert res["no_context"] == [1, 0], "no parent: vLLM's smart context"
    assert res["internal"] == [1, 0], "another kind of span"
    # for an exporter that needs SDK spans the records become the same span when exported
    (_, m_scope, made) = _span(res["materialized"])
    assert m_scope["name"] == "vllm.tracing.otel"
    assert {k: made.get(k) for k in ("traceId", "parentSpanId", "name", "kind")} == \
        {k: want.get(k) for k in ("traceId", "parentSpanId", "name", "kind")}
    assert key(made["attributes"]) == key(want["attributes"])
    # the hook failing (it has no guard layer of its own): logged once, off, and vLLM's span goes
    # vLLM's own way every time, the failing call's included
    assert res["broken"] == [3, 1], res["broken"]


def test_the_lean_context_extraction_gives_opentelemetrys_context_for_every_header():
    # the output adapter's extraction against vLLM's own (OpenTelemetry's propagator), the witness:
    # the same span context, or vLLM's own call for what the lean path does not take
    from opentelemetry import trace
    from ttftscope.collector.vllm_plugin.frontend import lean_extract
    from ttftscope.collector.vllm_plugin.runtime import new_traceparent
    from vllm.tracing.otel import extract_trace_context

    lean = lean_extract(extract_trace_context)
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = [{"traceparent": new_traceparent()} for _ in range(50)] + [
        {"traceparent": good, "x-ttftscope-handoff": "1.5"},
        {"traceparent": good[:-2] + "00"},  # not sampled
        {"traceparent": good[:-2] + "ff"},
        {"traceparent": good, "tracestate": "vendor=a,other=b"},
        {"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"},  # all-zero trace id
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01"},
        {"traceparent": good.upper()},
        {"traceparent": "01" + good[2:] + "-extra"},  # a later version with more fields
        {"traceparent": good + "-extra"},  # version 00 with more: invalid
        {"traceparent": " " + good + " "},
        {"traceparent": "ff" + good[2:]},
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01"},  # not hex
        {"traceparent": "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},  # int() would take it
        {"traceparent": "00-0af76519_6cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        {"other": "x"}, {}, None,
    ]
    taken = 0
    for h in headers:
        want, got = extract_trace_context(h), lean(h)
        if want is None:
            assert got is None, h
            continue
        w, g = trace.get_current_span(want).get_span_context(), trace.get_current_span(got).get_span_context()
        assert g == w and g.trace_flags == w.trace_flags and g.trace_state == w.trace_state, h
        assert g.is_remote == w.is_remote and g.is_valid == w.is_valid, h
        assert list(dict(got)) == list(dict(want)), h  # the same keys: only the span in the context
        taken += w.is_valid
    assert taken >= 50, "every traceparent the plugin writes has a valid context"
