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

from .adapters import ENGINE, FRONTEND, WORKER, Internal, adapter
from .runtime import RT, log


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
