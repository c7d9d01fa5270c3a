"""bench/llm_request_span: what vLLM's own ``llm_request`` span costs the API server's event
loop, through the OpenTelemetry SDK (vLLM's backend) and as the plugin records it (the
``vllm-request-span`` adapter), in one process, interleaved rounds.

vLLM's output processor builds the attributes and calls ``vllm.tracing.instrument_manual``
once per finished request, on the event loop that serves the clients. Timed here: that call
with vLLM's trace context and attributes as it makes them (the context extraction is outside
that timing in both), then the export thread's share: writing the spans a
request leaves as OTLP protobuf (the SDK spans with the plugin's writer, the records with its
encoder); and the context extraction itself, OpenTelemetry's propagator (vLLM's) against the
``output`` adapter's lean one. Warm caches: a serving process pays several times these (README, bench/overhead).

Usage: python bench/llm_request_span.py [--calls 5000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TTFTSCOPE_ENDPOINT", "http://127.0.0.1:9/v1/traces")  # nothing listens: no post lands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()

    import vllm.tracing as vt
    from opentelemetry.trace import SpanKind
    from ttftscope.collector import span_wire
    from ttftscope.collector.vllm_plugin import frontend, vllm_tracing
    from ttftscope.collector.vllm_plugin.runtime import RT, setup_otel
    from vllm.tracing.otel import extract_trace_context

    setup_otel("api_server")
    proc = RT.processor
    proc._stop.set()  # the bench drains the queues itself: no export thread
    proc._wake.set()
    proc._t.join()
    sdk_backend = vt._REGISTERED_TRACING_BACKENDS["otel"]
    vllm_tracing._install_request_span()
    ours = vt._REGISTERED_TRACING_BACKENDS["otel"]
    assert ours is not sdk_backend and RT.vllm_spans is not None, "the adapter did not install"
    headers = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    ctx = extract_trace_context(headers)

    def attributes(i: int) -> dict:  # as OutputProcessor.do_tracing builds them
        return {"gen_ai.latency.time_to_first_token": 0.0123, "gen_ai.latency.e2e": 0.05,
                "gen_ai.latency.time_in_queue": 0.0001, "gen_ai.usage.prompt_tokens": 123 + i % 7,
                "gen_ai.usage.completion_tokens": 4, "gen_ai.latency.time_in_model_prefill": 0.01,
                "gen_ai.latency.time_in_model_decode": 0.02, "gen_ai.latency.time_in_model_inference": 0.03,
                "gen_ai.request.id": f"cmpl-{i}", "gen_ai.request.top_p": 1.0, "gen_ai.request.max_tokens": 4,
                "gen_ai.request.temperature": 0.7, "gen_ai.request.n": 1}

    def loop_us(backend) -> float:
        vt._REGISTERED_TRACING_BACKENDS["otel"] = backend
        attrs = [attributes(i) for i in range(a.calls)]
        start = time.time_ns()
        t = time.perf_counter()
        for at in attrs:
            vt.instrument_manual("llm_request", start, None, at, ctx, SpanKind.SERVER)
        return (time.perf_counter() - t) / a.calls * 1e6

    def encode_us(sdk: bool) -> float:
        proc, src = RT.processor, RT.vllm_spans
        if sdk:
            spans = [proc._q.popleft() for _ in range(len(proc._q))]
            t = time.perf_counter()
            for i in range(0, len(spans), 512):
                span_wire.sdk_request(spans[i:i + 512])
            n = len(spans)
        else:
            recs = src.take(len(src))
            t = time.perf_counter()
            for i in range(0, len(recs), 512):
                src.encode(recs[i:i + 512])
            n = len(recs)
        assert n == a.calls, (n, "spans queued: a call was not recorded")
        return (time.perf_counter() - t) / n * 1e6

    rows = {"sdk": [], "plugin": []}
    for r in range(a.rounds):
        for name in (("sdk", "plugin") if r % 2 == 0 else ("plugin", "sdk")):
            on_loop = loop_us(sdk_backend if name == "sdk" else ours)
            rows[name].append((on_loop, encode_us(name == "sdk")))
    print(f"{'llm_request via':<18}{'event loop us/request':>24}{'export thread us/span':>24}   (median of {a.rounds} rounds)")
    med = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for k, v in rows.items()}
    for k, (x, y) in med.items():
        print(f"{k:<18}{x:>24.2f}{y:>24.2f}")
    print(f"plugin / sdk: event loop {med['plugin'][0] / med['sdk'][0]:.3f}x, export thread {med['plugin'][1] / med['sdk'][1]:.3f}x")
    # the trace context vLLM extracts for the call (the ``output`` adapter's lean extraction)
    lean = frontend.lean_extract(extract_trace_context)
    ext: dict[str, list[float]] = {"opentelemetry's propagator": [], "lean (the plugin's)": []}
    for r in range(a.rounds):
        for name, f in list(zip(ext, (extract_trace_context, lean), strict=True))[::1 if r % 2 == 0 else -1]:
            t = time.perf_counter()
            for _ in range(a.calls):
                f(headers)
            ext[name].append((time.perf_counter() - t) / a.calls * 1e6)
    base = statistics.median(ext["opentelemetry's propagator"])
    for name, v in ext.items():
        print(f"context extraction, {name:<27}{statistics.median(v):>8.2f} us/request  ({statistics.median(v) / base:.2f}x)")
    vt._REGISTERED_TRACING_BACKENDS["otel"] = sdk_backend


if __name__ == "__main__":
    main()
