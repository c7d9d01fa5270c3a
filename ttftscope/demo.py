"""``ttftscope demo``: the main job on the embedded store, no server to install.

For now (the data path): start a real collector, send a short burst of request traces with
the stock OpenTelemetry SDK over OTLP/HTTP, stop the collector (which flushes), and show
what landed through the same ClickHouse SQL the analyzer will use. It grows into the full
vLLM demo (plugin, load profiles, report, UI) as those parts land.
"""

from __future__ import annotations

import random
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _emit(endpoint: str, requests_n: int, run: str) -> int:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import SpanKind

    from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

    tp = TracerProvider(resource=Resource.create({ResourceAttr.SERVICE_NAME: "ttftscope-demo",
                                                  ResourceAttr.RUN: run}))
    tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint + "/v1/traces")))
    tr = tp.get_tracer("ttftscope.demo")
    rng = random.Random(7)
    t = time.time_ns()
    spans = 0
    for i in range(requests_n):
        t += int(rng.expovariate(1 / 20e6))  # Poisson arrivals, 50 req/s
        tok, queue, prefill, out = (int(rng.lognormvariate(m, 0.4) * 1e6) for m in (0.5, 1.5, 2.5, 0.3))
        start = t
        root = tr.start_span(SpanName.REQUEST, kind=SpanKind.SERVER, start_time=start,
                             attributes={Attr.REQUEST_ID: f"demo-{i}", Attr.PROMPT_TOKENS: rng.randint(16, 2048)})
        ctx = __import__("opentelemetry.trace", fromlist=["set_span_in_context"]).set_span_in_context(root)
        cur = start
        for name, dur in ((SpanName.TOKENIZE, tok), (SpanName.QUEUE, queue), (SpanName.PREFILL, prefill),
                          (SpanName.OUTPUT, out)):
            s = tr.start_span(name, context=ctx, start_time=cur, attributes={Attr.REQUEST_ID: f"demo-{i}"})
            s.end(end_time=cur + dur)
            cur += dur
            spans += 1
        root.set_attribute(Attr.VLLM_TTFT, (cur - start) / 1e9)
        root.end(end_time=cur + 1_000_000)
        spans += 1
    tp.shutdown()
    return spans


def run_demo(store_url: str, requests_n: int = 200) -> int:
    from ttftscope.collector.server import ServerConfig
    from ttftscope.collector.service import Collector
    from ttftscope.schemas.store import open_store
    from ttftscope.schemas.vocabulary import SpanName

    run = time.strftime("demo-%Y%m%d-%H%M%S")
    port = _free_port()
    print(f"[1/3] starting the collector on 127.0.0.1:{port} -> store {store_url}", flush=True)
    col = Collector(store_url, ServerConfig(port=port), segment_age_s=0.2).start()
    print(f"[2/3] sending {requests_n} request traces over OTLP/HTTP (run label {run})", flush=True)
    sent = _emit(col.url, requests_n, run)
    ok = col.stop()
    print(f"      {sent} spans sent; collector flushed: {'yes' if ok else 'NO'}", flush=True)
    print("[3/3] what landed in otel_traces (same ClickHouse SQL as the analyzer):", flush=True)
    st = open_store(store_url)
    out = st.query_text(
        "SELECT SpanName, count() AS spans, round(quantile(0.5)(Duration) / 1e6, 2) AS p50_ms, "
        "round(quantile(0.99)(Duration) / 1e6, 2) AS p99_ms FROM otel_traces "
        "WHERE ResourceAttributes['ttftscope.run'] = {run:String} GROUP BY SpanName ORDER BY SpanName",
        "PrettyCompactMonoBlock", {"run": run})
    sys.stdout.write(out.decode())
    runs = st.query("SELECT uniqExact(ResourceAttributes['ttftscope.run']) AS runs, count() AS spans "
                    "FROM otel_traces").row(0)
    print(f"store now holds {runs[1]} spans from {runs[0]} run(s). Try:\n"
          f"  ttftscope sql --store {store_url} \"SELECT SpanName, count() FROM otel_traces GROUP BY 1\"")
    n = st.query("SELECT count() FROM otel_traces WHERE ResourceAttributes['ttftscope.run'] = {r:String} "
                 "AND SpanName = {n:String}", {"r": run, "n": SpanName.REQUEST}).item()
    return 0 if ok and n == requests_n else 1
