"""API-server adapters: vLLM's own tracing kept on, one trace per request, ``tokenize``
(chat template + tokenizer) and ``output`` (first token produced -> handed to the client)."""

from __future__ import annotations

import contextvars
import functools
import re
import time

from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import HANDOFF_HEADER, Attr, SpanName

from .adapters import FRONTEND, Internal, adapter
from .http import ACTIVE, RDV, emit_deliver, emit_receive, trace_id_of
from .runtime import RT, hot, log, mono_to_wall, new_traceparent, sampled, span, turn_off

_RENDER: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("ttftscope_render", default=None)


@adapter("vllm-tracing", roles=FRONTEND, what="keeps vLLM's own tracing (llm_request, start-up spans) on, "
         "pointed at the collector",
         internals=[Internal("vllm.v1.engine.async_llm", "AsyncLLM.__init__"),
                    Internal("vllm.config.observability", "ObservabilityConfig.otlp_traces_endpoint", "attribute")])
def _install_vllm_tracing() -> None:
    from vllm.v1.engine import async_llm

    endpoint = RT.config.endpoint
    orig_init = async_llm.AsyncLLM.__init__

    @functools.wraps(orig_init)
    def init(self, vllm_config, *a, **kw):
        try:
            oc = vllm_config.observability_config
            if oc.otlp_traces_endpoint is None:
                object.__setattr__(oc, "otlp_traces_endpoint", endpoint)
        except Exception:  # noqa: BLE001
            log.exception("ttftscope: could not enable vLLM tracing")
        return orig_init(self, vllm_config, *a, **kw)

    async_llm.AsyncLLM.__init__ = init


@adapter("render-timing", roles=FRONTEND, what="times rendering (chat template + tokenizer) per request task",
         internals=[Internal("vllm.renderers.base", "BaseRenderer.render_chat_async"),
                    Internal("vllm.renderers.base", "BaseRenderer.render_cmpl_async")])
def _install_render_timing() -> None:
    from vllm.renderers.base import BaseRenderer

    def make(orig):
        @functools.wraps(orig)
        async def timed(self, *a, **kw):
            t0 = time.time()
            try:
                return await orig(self, *a, **kw)
            finally:
                _RENDER.set((t0, time.time()))
        return timed

    for meth in ("render_chat_async", "render_cmpl_async"):
        setattr(BaseRenderer, meth, make(getattr(BaseRenderer, meth)))


@adapter("trace-context", roles=FRONTEND, what="one trace per request (the client's traceparent, else a new "
         "one with the head-sampling decision); emits ttftscope.tokenize",
         internals=[Internal("vllm.entrypoints.serve.engine.serving", "BaseServing._get_trace_headers")])
def _install_trace_context() -> None:
    from vllm.entrypoints.serve.engine import serving

    orig_headers = serving.BaseServing._get_trace_headers
    live = [True]  # the tokenize hook (hot: no guard of its own): off, logged once, if it raises

    @functools.wraps(orig_headers)
    async def get_trace_headers(self, headers):
        th = await orig_headers(self, headers)
        try:
            if not th or "traceparent" not in th:
                th = {**(th or {}), "traceparent": new_traceparent()}
            if sampled(th):  # the handoff to the engine core starts here: intake's start
                th = {**th, HANDOFF_HEADER: repr(time.time())}
        except Exception:  # noqa: BLE001
            log.exception("ttftscope: trace header hook failed")
            return th
        if live[0]:
            try:
                _emit_tokenize(th)
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                turn_off(live, "tokenize")
        return th

    serving.BaseServing._get_trace_headers = get_trace_headers


#: the tokenize span's attributes: the same every time, never changed (one dict, not one a request)
_TOKENIZE_ATTRS = {Attr.PHASE: Phase.TOKENIZE.value}


@hot("tokenize")
def _emit_tokenize(trace_headers) -> None:
    """Once a request, on the event loop that serves the clients (hot: its caller catches)."""
    r = _RENDER.get()
    if r is None or not sampled(trace_headers):
        return
    _RENDER.set(None)
    span(SpanName.TOKENIZE, r[0], r[1], _TOKENIZE_ATTRS, trace_headers)
    emit_receive(r[0], trace_headers)


@adapter("output", roles=FRONTEND, what="the first token's time for ttftscope.deliver; keeps vLLM's tracing "
         "from asserting when stats are off; llm_request's trace context read without a new OpenTelemetry "
         "propagator a request",
         internals=[Internal("vllm.v1.engine.output_processor", "OutputProcessor.do_tracing"),
                    Internal("vllm.v1.engine.output_processor", "extract_trace_context"),
                    Internal("vllm.v1.engine.output_processor", "RequestState.stats", "attribute"),
                    Internal("vllm.v1.engine.output_processor", "RequestState.external_req_id", "attribute"),
                    Internal("vllm.v1.engine", "EngineCoreOutput.trace_headers", "attribute"),
                    Internal("vllm.v1.metrics.stats", "RequestStateStats.first_token_ts", "attribute"),
                    Internal("vllm.v1.metrics.stats", "RequestStateStats.arrival_time", "attribute"),
                    Internal("vllm.v1.metrics.stats", "RequestStateStats.first_token_latency", "attribute")])
def _install_output() -> None:
    from vllm.v1.engine import output_processor as op

    orig_trace = op.OutputProcessor.do_tracing
    live = [True]  # hot: no guard of its own; off, logged once, if it raises

    @functools.wraps(orig_trace)
    def do_tracing(self, engine_core_output, req_state, iteration_stats):
        if req_state.stats is None or iteration_stats is None:
            return None  # stats off (--disable-log-stats): vLLM would assert here
        if live[0]:
            try:
                _emit_output(engine_core_output, req_state)
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                turn_off(live, "output")
        return orig_trace(self, engine_core_output, req_state, iteration_stats)

    op.OutputProcessor.do_tracing = do_tracing
    op.extract_trace_context = lean_extract(op.extract_trace_context)


#: a W3C traceparent of version 00 as the plugin writes it (``new_traceparent``) and as
#: OpenTelemetry's propagator accepts it (lower-case hex, nothing after the flags)
_TRACEPARENT_00 = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def lean_extract(orig):
    """vLLM's ``extract_trace_context`` (the output processor's, once a request, on the API
    server's event loop) with the context of a plain version-00 ``traceparent`` built directly:
    OpenTelemetry's propagator, made anew for each call, gets the header through a getter,
    searches it with a regex that allows what we never send, and looks for ``tracestate``
    (3.8 against 2.1 us a request warm, ``bench/llm_request_span.py``). The same context: a
    non-recording span of the same ``SpanContext`` (remote, its flags, the default trace state)
    in an empty ``Context``; anything else (a ``tracestate``, another version, all-zero ids)
    goes to vLLM's own."""
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

    match = _TRACEPARENT_00.fullmatch

    @functools.wraps(orig)
    def extract_trace_context(headers):
        tp = headers.get("traceparent") if headers else None
        if type(tp) is not str or match(tp) is None or "tracestate" in headers:
            return orig(headers)
        tid, sid = int(tp[3:35], 16), int(tp[36:52], 16)
        if not tid or not sid:
            return orig(headers)
        return set_span_in_context(NonRecordingSpan(SpanContext(tid, sid, True, TraceFlags(int(tp[53:], 16)))),
                                   Context())

    return extract_trace_context


@hot("output")
def _emit_output(engine_core_output, req_state) -> None:
    """A request's output reaches vLLM's tracing (once a request; hot: its caller catches)."""
    th = engine_core_output.trace_headers
    if not sampled(th):
        return
    m = req_state.stats
    if not m.first_token_ts:
        return
    produced = m.first_token_ts + mono_to_wall()  # engine clock (monotonic) -> wall, same host
    handled = m.arrival_time + m.first_token_latency  # the output processor had it: vLLM's TTFT ends
    if ACTIVE[0]:  # the client-TTFT middleware knows when the bytes were written
        RDV.on_produced(trace_id_of(th.get("traceparent", "")), produced, handled, req_state.external_req_id, th)
    else:
        emit_deliver(produced, handled, handled, req_state.external_req_id, th)
