"""vLLM's own tracer (``llm_request``, start-up spans) on the plugin's export pipeline.

vLLM 0.32's ``init_otel_tracer`` builds a TracerProvider of its own with the SDK's
BatchSpanProcessor and OTLP exporter and takes its tracer from that provider, whatever the
global one is. With the plugin on, every vLLM process would run a second export thread that
encodes with the SDK and posts with ``requests``. This adapter keeps vLLM's tracer and its
resource (``vllm.process_id``, ``vllm.process_kind`` ... which the cold-start analysis reads)
but hands its spans to the plugin's bounded processor: one export thread per process, one
keep-alive connection, a queue that never grows without bound.
"""

from __future__ import annotations

import functools
import os
import time

from .adapters import ENGINE, FRONTEND, WORKER, Internal, adapter
from .runtime import RT, hot, log, turn_off


@adapter("vllm-tracer", roles=FRONTEND | ENGINE | WORKER,
         what="vLLM's own spans (llm_request, start-up) exported by the plugin's processor, not a second SDK pipeline",
         internals=[Internal("vllm.tracing.otel", "init_otel_tracer"),
                    Internal("vllm.tracing", "_REGISTERED_TRACING_BACKENDS", "attribute")])
def _install_vllm_tracer() -> None:
    import vllm.tracing as vt
    from vllm.tracing import otel

    orig = otel.init_otel_tracer

    @functools.wraps(orig)
    def init_otel_tracer(instrumenting_module_name, otlp_traces_endpoint, extra_attributes=None):
        proc = RT.processor
        if proc is None:  # the plugin's pipeline is not up in this process: vLLM's own way
            return orig(instrumenting_module_name, otlp_traces_endpoint, extra_attributes)
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = otlp_traces_endpoint  # as vLLM does, for children
            attrs = {"vllm.instrumenting_module_name": instrumenting_module_name, "vllm.process_id": str(os.getpid()),
                     **(extra_attributes or {})}
            provider = TracerProvider(resource=Resource.create(attrs))
            provider.add_span_processor(proc)
            return provider.get_tracer(instrumenting_module_name)
        except Exception:  # noqa: BLE001 - never lose vLLM's tracing over ours
            log.exception("ttftscope: vLLM's tracer kept on its own pipeline")
            return orig(instrumenting_module_name, otlp_traces_endpoint, extra_attributes)

    otel.init_otel_tracer = init_otel_tracer  # init_otel_worker_tracer calls it by name
    backends = vt._REGISTERED_TRACING_BACKENDS
    entry = backends.get("otel")
    if entry is not None and entry[1] is orig:  # init_tracer looks it up here
        backends["otel"] = (entry[0], init_otel_tracer, *entry[2:])


@adapter("vllm-request-span", roles=FRONTEND,
         what="vLLM's llm_request span kept as a plain record for the export thread, not built as an SDK span on the "
              "API server's event loop",
         internals=[Internal("vllm.tracing.otel", "manual_instrument_otel"),
                    Internal("vllm.tracing", "_REGISTERED_TRACING_BACKENDS", "attribute")])
def _install_request_span() -> None:
    """vLLM's output processor computes ``llm_request``'s attributes (its own ``gen_ai.*``
    figures, the independent witness the truth tests read) and hands them to
    ``instrument_manual``, whose OpenTelemetry backend builds an SDK span on the event loop
    that serves the clients: a sampler, ids, validated attributes, a processor call (32-77 us
    a request warm, bench/llm_request_span.py). This backend keeps vLLM's call and its
    attributes as they are and records them as the plugin records its own spans (an append);
    the export thread writes the same OTLP span (name, kind, parent, times, attributes). It
    takes only what the SDK would have exported as is: a server span under a request's trace,
    through the plugin's own provider (the global one, which vLLM's call reads), whose sampler
    follows the parent's flag; anything else goes to vLLM's own backend."""
    import vllm.tracing as vt
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import ParentBased
    from opentelemetry.trace import SpanKind
    from vllm.tracing import otel

    from ..otel_setup import DeferredSpans

    backends = vt._REGISTERED_TRACING_BACKENDS
    entry = backends.get("otel")
    proc, provider, mine = RT.processor, RT.provider, RT.deferred
    # vLLM's call reads the global provider, which is set once: the plugin's (setup_otel) or never
    if (entry is None or len(entry) < 5 or proc is None or trace.get_tracer_provider() is not provider
            or not isinstance(getattr(provider, "sampler", None), ParentBased)):
        log.info("ttftscope: vLLM's request spans stay on the OpenTelemetry SDK")
        return
    orig = entry[4]
    # (the tracer: for an exporter that needs SDK spans, the records become them when exported)
    src = DeferredSpans(provider.get_tracer(otel.__name__), mine.resource if mine is not None else None,
                        scope=(otel.__name__, ""), max_queue=proc.max_queue, max_batch=proc.max_batch,
                        kind=SpanKind.SERVER)
    proc.add_source(src)
    RT.vllm_spans = src
    scalars = frozenset((str, int, float, bool))
    current_span = trace.get_current_span

    live = [True]  # hot: no guard of its own; off, logged once, if it raises

    @hot("llm_request")
    def record(span_name, start_time, end_time, attributes, context) -> bool:
        sc = current_span(context).get_span_context()
        # every value a plain scalar (the types' set, in C: no Python per attribute)
        if not sc.is_valid or (attributes and not scalars.issuperset(map(type, attributes.values()))):
            return False
        if sc.trace_flags.sampled:  # else the SDK's parent-based sampler drops it: so do we
            src.add(span_name, start_time / 1e9, (end_time or time.time_ns()) / 1e9, attributes or {}, context)
        return True

    def manual_instrument(span_name, start_time, end_time=None, attributes=None, context=None, kind=None):
        if context is not None and kind is SpanKind.SERVER and live[0]:
            try:
                if record(span_name, start_time, end_time, attributes, context):
                    return None
            except Exception:  # noqa: BLE001 - never lose vLLM's span over ours: it goes vLLM's own way
                turn_off(live, "llm_request")
        return orig(span_name, start_time, end_time, attributes, context, kind)

    backends["otel"] = (*entry[:4], manual_instrument, *entry[5:])
