"""The ttftscope vLLM plugin (entry point group ``vllm.general_plugins``).

``register()`` runs once in every vLLM process (API server, engine core, each worker). It
sets up OpenTelemetry for the process (OTLP/HTTP to the collector, standard ``OTEL_*``
variables honoured, ``TTFTSCOPE_ENDPOINT`` as a shortcut) and installs the hooks of that
process's role, each wrapped so that a failure disables the hook and never reaches vLLM:

* API server: keeps vLLM's own tracing on (``llm_request`` and start-up spans flow to the
  same collector), gives every request a W3C ``traceparent`` (the client's, else a new one
  with the head-sampling decision) so every process's spans land in **one trace per
  request**, and emits ``tokenize`` (chat template + tokenizer) and ``output`` (first token
  produced -> handed to the client). It also stops vLLM's tracing from asserting when stats
  are off.
* engine core: ``queue`` (queued -> first scheduled), one ``prefill`` span per chunk (step,
  tokens computed, tokens from the prefix cache, batch size) and one ``step`` span per
  engine step (prefill/decode tokens, running/waiting); the step number rides on the
  ``SchedulerOutput`` to the workers.
* workers: ``allreduce`` per step and rank (count, bytes, time of the tensor-parallel
  collectives), and the cold start (process start -> ready) next to vLLM's loading spans.
  On CUDA, step time comes from CUDA events read later without synchronising; per-call
  collective timing only under ``--enforce-eager`` (Python does not run inside CUDA graphs
  or compiled graphs, and the hooks never add Python there).

Environment: ``TTFTSCOPE_ENABLED=0`` turns it off; ``TTFTSCOPE_SAMPLE_RATIO`` (default 1.0)
samples requests at the head; ``TTFTSCOPE_RUN`` labels the run (resource attribute);
``TTFTSCOPE_SELF_TIMING=DIR`` makes every process account the time spent in its hooks and
its export thread and write it to ``DIR/<role>-<pid>.json`` every second (bench/overhead).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import multiprocessing
import os
import random
import sys
import threading
import time
from collections import OrderedDict

from ttftscope.schemas.vocabulary import (
    VOCABULARY_VERSION,
    Attr,
    ProcessRole,
    ResourceAttr,
    SpanName,
)

log = logging.getLogger("vllm.ttftscope")  # shown through vLLM's own log handlers

_STATE: dict = {"registered": False, "tracer": None, "processor": None, "role": None}
_RENDER: contextvars.ContextVar[tuple[float, float] | None] = contextvars.ContextVar("ttftscope_render", default=None)
_MONO_TO_WALL = time.time() - time.monotonic()


def _enabled() -> bool:
    return os.environ.get("TTFTSCOPE_ENABLED", "1").lower() not in ("0", "false", "no", "off")


def _sample_ratio() -> float:
    try:
        return min(max(float(os.environ.get("TTFTSCOPE_SAMPLE_RATIO", "1")), 0.0), 1.0)
    except ValueError:
        return 1.0


def detect_role() -> str:
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore") or "EngineCore" in name:
        return ProcessRole.ENGINE_CORE.value
    if "Worker" in name:
        return ProcessRole.WORKER.value
    argv = " ".join(sys.argv)
    if "api_server" in argv or " serve" in argv or "openai" in argv:
        return ProcessRole.API_SERVER.value
    return ProcessRole.OTHER.value


_SELF_TIMING = os.environ.get("TTFTSCOPE_SELF_TIMING")
_SELF = {"hooks_s": 0.0, "hook_calls": 0}


def _guard(name: str):
    """Decorator for hook bodies: any exception disables that hook, logged once."""
    def deco(fn):
        state = {"broken": False}

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if state["broken"]:
                return None
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                state["broken"] = True
                log.exception("ttftscope: hook %s failed and is now disabled", name)
                return None

        if not _SELF_TIMING:
            return wrapper

        @functools.wraps(fn)
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return wrapper(*a, **kw)
            finally:
                _SELF["hooks_s"] += time.perf_counter() - t
                _SELF["hook_calls"] += 1
        return timed
    return deco


def _self_timing_writer(role: str) -> None:
    """TTFTSCOPE_SELF_TIMING: the plugin's own cost in this process, written every second."""
    import json
    from pathlib import Path

    out = Path(_SELF_TIMING) / f"{role}-{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    while True:
        proc = _STATE.get("processor")
        doc = {"role": role, "pid": os.getpid(), "wall": time.time(), "process_cpu_s": time.process_time(),
               "hooks_s": _SELF["hooks_s"], "hook_calls": _SELF["hook_calls"],
               "export_cpu_s": getattr(proc, "cpu_s", 0.0), "exported": getattr(proc, "exported", 0)}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, out)
        time.sleep(1.0)


# ------------------------------------------------------------------------------ setup

def _setup_otel(role: str) -> None:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from .otel_setup import BoundedBatchSpanProcessor, DeferredSpans, traces_endpoint

    endpoint = traces_endpoint()
    # vLLM's own tracing exports with these: make it speak OTLP/HTTP to the same endpoint
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    os.environ.setdefault("OTEL_SERVICE_NAME", "vllm")
    attrs = {
        ResourceAttr.ROLE: role,
        ResourceAttr.PROCESS_PID: os.getpid(),
        ResourceAttr.SERVICE_INSTANCE: f"{role}-{os.getpid()}",
        Attr.SCHEMA_VERSION: VOCABULARY_VERSION,
    }
    if run := os.environ.get("TTFTSCOPE_RUN"):
        attrs[ResourceAttr.RUN] = run
    resource = Resource.create(attrs)
    provider = TracerProvider(resource=resource)
    proc = BoundedBatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=2))
    provider.add_span_processor(proc)
    current = trace.get_tracer_provider()
    if not hasattr(current, "add_span_processor"):
        # no SDK provider yet: ours becomes the global one, so vLLM's own spans
        # (llm_request, start-up) flow through the same bounded pipeline
        trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("ttftscope.vllm", "0.1.0")
    deferred = DeferredSpans(tracer, resource)  # hooks only append tuples; the export thread encodes them
    proc.add_source(deferred)
    _STATE.update(tracer=tracer, processor=proc, provider=provider, deferred=deferred)
    import atexit
    from multiprocessing import util as mp_util

    # vLLM's engine core and workers are multiprocessing children: a forked child leaves
    # through os._exit, which skips atexit but runs multiprocessing's finalizers
    atexit.register(_on_exit)
    mp_util.Finalize(None, _on_exit, exitpriority=100)


def _on_exit() -> None:
    """Last spans out at process exit: the open run of decode steps, then the export queue."""
    if _STATE.get("exited"):
        return
    _STATE["exited"] = True
    try:
        if (st := _STATE.get("engine")) is not None:
            _flush_decode_run(st)
        _STATE["processor"].shutdown()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def register() -> None:
    """The entry point vLLM calls in every process. Idempotent, cheap, no CUDA."""
    if _STATE["registered"] or not _enabled():
        return
    _STATE["registered"] = True
    _STATE["registered_at"] = time.time()
    try:
        role = detect_role()
        _STATE["role"] = role
        _setup_otel(role)
        if role in (ProcessRole.API_SERVER.value, ProcessRole.OTHER.value):
            _install_frontend_hooks()
        if role in (ProcessRole.ENGINE_CORE.value, ProcessRole.OTHER.value):
            _install_engine_hooks()
        if role in (ProcessRole.WORKER.value, ProcessRole.OTHER.value):
            _install_worker_hooks()
        if _SELF_TIMING:
            threading.Thread(target=_self_timing_writer, args=(role,), name="ttftscope-self-timing", daemon=True).start()
        log.info("ttftscope plugin active (%s, pid %d)", role, os.getpid())
    except Exception:  # noqa: BLE001
        log.exception("ttftscope plugin could not start; vLLM continues without it")


# ------------------------------------------------------------------- span helpers

def _sampled(trace_headers) -> bool:
    tp = (trace_headers or {}).get("traceparent", "")
    return len(tp) >= 55 and tp[-2:] != "00"


def _span(name: str, start_s: float, end_s: float, attrs: dict, parent=None) -> None:
    """Record a finished span (an O(1) append; the export thread builds the SDK span).
    ``parent``: the request's trace headers, an OpenTelemetry Context, or None."""
    d = _STATE.get("deferred")
    if d is not None:
        d.add(name, start_s, end_s, attrs, parent)


_INTERNAL_SUFFIX = __import__("re").compile(r"-[0-9a-f]{8}$")


def _ext_id(req) -> str:
    """The request id the client and the API server see (the engine adds a random suffix)."""
    ext = getattr(req, "external_req_id", None)
    if ext:
        return ext
    return _INTERNAL_SUFFIX.sub("", req.request_id)


def _new_traceparent() -> str:
    flags = "01" if random.random() < _sample_ratio() else "00"
    return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64) or 1:016x}-{flags}"


# ---------------------------------------------------------------------- API server

def _install_frontend_hooks() -> None:
    from vllm.entrypoints.serve.engine import serving as base_serving

    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")

    # 1. keep vLLM's own tracing on, pointed at our collector
    from vllm.v1.engine import async_llm

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

    # 2. render (chat template + tokenizer) times, per request task
    from vllm.renderers import base as renderers

    for meth in ("render_chat_async", "render_cmpl_async"):
        orig = getattr(renderers.BaseRenderer, meth, None) if hasattr(renderers, "BaseRenderer") else None
        if orig is None:
            cls = next((c for c in vars(renderers).values() if isinstance(c, type) and hasattr(c, meth)), None)
            orig = getattr(cls, meth, None) if cls else None
            if cls is None:
                continue
        else:
            cls = renderers.BaseRenderer

        def make(orig):
            @functools.wraps(orig)
            async def timed(self, *a, **kw):
                t0 = time.time()
                try:
                    return await orig(self, *a, **kw)
                finally:
                    _RENDER.set((t0, time.time()))
            return timed

        setattr(cls, meth, make(orig))

    # 3. one trace per request: the client's traceparent, else a new one
    orig_headers = base_serving.BaseServing._get_trace_headers

    @functools.wraps(orig_headers)
    async def get_trace_headers(self, headers):
        th = await orig_headers(self, headers)
        try:
            if not th or "traceparent" not in th:
                th = {**(th or {}), "traceparent": _new_traceparent()}
            _emit_tokenize(th)
        except Exception:  # noqa: BLE001
            log.exception("ttftscope: trace header hook failed")
        return th

    base_serving.BaseServing._get_trace_headers = get_trace_headers

    # 4. output span at request finish; vLLM's own tracing must not assert without stats
    from vllm.v1.engine import output_processor as op

    orig_trace = op.OutputProcessor.do_tracing

    @functools.wraps(orig_trace)
    def do_tracing(self, engine_core_output, req_state, iteration_stats):
        if req_state.stats is None or iteration_stats is None:
            return None  # stats off (--disable-log-stats): vLLM would assert here
        _emit_output(engine_core_output, req_state)
        return orig_trace(self, engine_core_output, req_state, iteration_stats)

    op.OutputProcessor.do_tracing = do_tracing


@_guard("tokenize")
def _emit_tokenize(trace_headers) -> None:
    r = _RENDER.get()
    if r is None or not _sampled(trace_headers):
        return
    _RENDER.set(None)
    _span(SpanName.TOKENIZE, r[0], r[1], {Attr.PHASE: "tokenize"}, trace_headers)


@_guard("output")
def _emit_output(engine_core_output, req_state) -> None:
    th = engine_core_output.trace_headers
    if not _sampled(th):
        return
    m = req_state.stats
    if not m.first_token_ts:
        return
    produced = m.first_token_ts + _MONO_TO_WALL  # engine clock (monotonic) -> wall, same host
    delivered = m.arrival_time + m.first_token_latency
    _span(SpanName.OUTPUT, min(produced, delivered), delivered,
          {Attr.REQUEST_ID: req_state.external_req_id, Attr.PHASE: "output"}, th)


# ---------------------------------------------------------------------- engine core

class _EngineState:
    def __init__(self) -> None:
        self.step = 0
        self.queued: OrderedDict[str, float] = OrderedDict()
        self.pending: OrderedDict[int, tuple] = OrderedDict()
        self.chunks: dict[str, int] = {}
        self.engine = f"engine-{os.getpid()}"
        self.lock = threading.Lock()
        self.decode_run: list | None = None  # consecutive decode-only steps, merged into one span


def _install_engine_hooks() -> None:
    from vllm.v1.core.sched import scheduler as sched

    st = _EngineState()
    _STATE["engine"] = st

    def flush_idle() -> None:  # a run of decode steps ends when the engine goes idle, too
        while True:
            time.sleep(0.25)
            try:
                _flush_decode_run(st, idle_s=0.25)
            except Exception:  # noqa: BLE001
                log.exception("ttftscope: idle flush failed")
                return

    threading.Thread(target=flush_idle, name="ttftscope-step-flush", daemon=True).start()

    S = sched.Scheduler

    orig_add = S.add_request

    @functools.wraps(orig_add)
    def add_request(self, request):
        _on_add(st, request)
        return orig_add(self, request)

    orig_schedule = S.schedule

    @functools.wraps(orig_schedule)
    def schedule(self, *a, **kw):
        t0 = time.time()
        out = orig_schedule(self, *a, **kw)
        _on_schedule(st, self, out, t0, time.time())
        return out

    orig_update = S.update_from_output

    @functools.wraps(orig_update)
    def update_from_output(self, scheduler_output, *a, **kw):
        _on_step_done(st, self, scheduler_output, time.time())
        return orig_update(self, scheduler_output, *a, **kw)

    S.add_request, S.schedule, S.update_from_output = add_request, schedule, update_from_output

    # the plugin runs inside EngineCore.__init__, before it allocates the KV cache: the
    # end of that allocation is when the engine can serve
    from vllm.v1.engine import core

    orig_kv = core.EngineCore._initialize_kv_caches

    @functools.wraps(orig_kv)
    def init_kv(self, *a, **kw):
        r = orig_kv(self, *a, **kw)
        _emit_process_ready("engine_core")
        return r

    core.EngineCore._initialize_kv_caches = init_kv


@_guard("add_request")
def _on_add(st: _EngineState, request) -> None:
    if not _sampled(getattr(request, "trace_headers", None)):
        return
    with st.lock:
        st.queued[request.request_id] = time.time()
        while len(st.queued) > 100_000:  # bounded even if requests vanish
            st.queued.popitem(last=False)


@_guard("schedule")
def _on_schedule(st: _EngineState, sched, out, t0: float, t1: float) -> None:
    with st.lock:
        st.step += 1
        step = st.step
    try:
        object.__setattr__(out, "_ttftscope_step", step)
    except Exception:  # noqa: BLE001
        pass
    chunks = []
    for req_id, n in getattr(out, "num_scheduled_tokens", {}).items():
        req = sched.requests.get(req_id)
        if req is None or not _sampled(req.trace_headers):
            continue
        before = req.num_computed_tokens - n  # schedule() already advanced it
        if before < req.num_prompt_tokens:  # a prefill chunk
            idx = st.chunks.get(req_id, 0)
            st.chunks[req_id] = idx + 1
            phash = ""
            if idx == 0:
                toks = getattr(req, "prompt_token_ids", None)
                if toks is not None and len(toks) >= 64:
                    phash = format(hash(tuple(toks[:64])) & 0xFFFFFFFFFFFF, "x")  # same process, same hash seed
            chunks.append((req_id, n, max(getattr(req, "num_cached_tokens", 0) or 0, 0), idx, req.trace_headers,
                           _ext_id(req), phash))
    for nr in getattr(out, "scheduled_new_reqs", []) or []:
        req = sched.requests.get(nr.req_id)
        with st.lock:
            q = st.queued.pop(nr.req_id, None)
        if q is not None and req is not None:
            _span(SpanName.QUEUE, q, t0, {Attr.REQUEST_ID: _ext_id(req), Attr.PHASE: "queue",
                                          Attr.PRIORITY: str(getattr(req, "priority", 0))}, req.trace_headers)
    with st.lock:
        st.pending[id(out)] = (step, t0, t1, chunks, len(out.num_scheduled_tokens), len(sched.running),
                               len(sched.waiting), out.total_num_scheduled_tokens)
        while len(st.pending) > 64:
            st.pending.popitem(last=False)


@_guard("step")
def _on_step_done(st: _EngineState, sched, out, t_end: float) -> None:
    with st.lock:
        item = st.pending.pop(id(out), None)
    if item is None:
        return
    step, t0, t1, chunks, batch, running, waiting, total = item
    prefill_tokens = sum(c[1] for c in chunks)
    for req_id, n, cached, idx, th, ext, phash in chunks:
        attrs = {Attr.REQUEST_ID: ext, Attr.PHASE: "prefill", Attr.STEP: step, Attr.CHUNK: idx,
                 Attr.TOKENS_COMPUTED: n, Attr.TOKENS_CACHED: cached, Attr.BATCH_SIZE: batch, Attr.ENGINE: st.engine}
        if phash:
            attrs[Attr.PREFIX_HASH] = phash
        _span(SpanName.PREFILL, t1, t_end, attrs, th)
        req = sched.requests.get(req_id)
        if req is None or req.num_computed_tokens >= req.num_prompt_tokens:
            st.chunks.pop(req_id, None)
    if not total:
        return
    decode = max(total - prefill_tokens, 0)
    if prefill_tokens == 0 and waiting == 0:
        # decode-only steps with nobody waiting cannot delay a first token: merge runs of them
        # into one span (the timeline stays continuous at a fraction of the cost)
        with st.lock:
            r = st.decode_run
            if r is None:
                st.decode_run = [t0, t_end, 1, decode, running, step, step]
            else:
                r[1], r[2], r[3], r[4], r[6] = t_end, r[2] + 1, r[3] + decode, max(r[4], running), step
            full = st.decode_run[2] >= 512 or t_end - st.decode_run[0] > 1.0
        if full:
            _flush_decode_run(st)
        return
    _flush_decode_run(st)
    _span(SpanName.STEP, t0, t_end, {
        Attr.STEP: step, Attr.STEP_PREFILL_TOKENS: prefill_tokens, Attr.STEP_DECODE_TOKENS: decode,
        Attr.RUNNING: running, Attr.WAITING: waiting, Attr.BATCH_SIZE: batch, Attr.ENGINE: st.engine})


def _flush_decode_run(st: _EngineState, idle_s: float | None = None) -> None:
    with st.lock:
        r = st.decode_run
        if r is None or (idle_s is not None and time.time() - r[1] < idle_s):
            return
        st.decode_run = None
    _span(SpanName.STEP, r[0], r[1], {
        Attr.STEP: r[5], Attr.STEP_LAST: r[6], Attr.STEP_COUNT: r[2], Attr.STEP_PREFILL_TOKENS: 0, Attr.STEP_DECODE_TOKENS: r[3],
        Attr.RUNNING: r[4], Attr.WAITING: 0, Attr.ENGINE: st.engine})


# --------------------------------------------------------------------------- workers

class _WorkerState:
    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.time = 0.0
        self.first = None
        self.step = None
        self.rank = None
        self.tp = 1
        self.engine = f"engine-{os.getppid()}"  # the engine core that spawned this worker
        self.cuda_pending: list = []
        self.calls = 0  # execute_model calls, for the sampled profiler windows
        self.profile_every = _profile_every()


def _install_worker_hooks() -> None:
    ws = _WorkerState()
    _STATE["worker"] = ws
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc

        orig_ar = cc.CpuCommunicator.all_reduce

        @functools.wraps(orig_ar)
        def all_reduce(self, input_):
            t = time.perf_counter()
            w = time.time()
            out = orig_ar(self, input_)
            _on_allreduce(ws, input_, w, time.perf_counter() - t)
            return out

        cc.CpuCommunicator.all_reduce = all_reduce
    except Exception:  # noqa: BLE001
        log.info("ttftscope: no CPU communicator to instrument")
    _install_cuda_allreduce_eager(ws)

    from vllm.v1.worker import worker_base

    orig_exec = getattr(worker_base.WorkerBase, "execute_model", None)
    targets = []
    for modname in ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker"):
        try:
            mod = __import__(modname, fromlist=["x"])
        except Exception:  # noqa: BLE001
            continue
        for cls in vars(mod).values():
            if isinstance(cls, type) and "execute_model" in vars(cls) and cls.__module__ == mod.__name__:
                targets.append(cls)
    if orig_exec is not None and not targets:
        targets.append(worker_base.WorkerBase)
    for cls in targets:
        orig = cls.execute_model

        def make(orig):
            @functools.wraps(orig)
            def execute_model(self, scheduler_output, *a, **kw):
                _on_exec_start(ws, scheduler_output, self)
                try:
                    if _profile_now(ws):
                        return _profiled(ws, orig, self, scheduler_output, *a, **kw)
                    return orig(self, scheduler_output, *a, **kw)
                finally:
                    _on_exec_end(ws)
            return execute_model

        cls.execute_model = make(orig)
    # ready = the end of warmup/compilation, on whichever worker class defines it
    for modname in ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.cpu_worker"):
        try:
            mod = __import__(modname, fromlist=["x"])
        except Exception:  # noqa: BLE001
            continue
        for cls in list(vars(mod).values()):
            if isinstance(cls, type) and cls.__module__ == mod.__name__ and "compile_or_warm_up_model" in vars(cls):
                orig_ready = vars(cls)["compile_or_warm_up_model"]

                def make_ready(orig_ready):
                    @functools.wraps(orig_ready)
                    def wrapped(self, *a, **kw):
                        r = orig_ready(self, *a, **kw)
                        _emit_process_ready("worker")
                        return r
                    return wrapped

                cls.compile_or_warm_up_model = make_ready(orig_ready)


def _install_cuda_allreduce_eager(ws: _WorkerState) -> None:
    """Per-call collective timing on CUDA, only with --enforce-eager (no graphs to break)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return
        from vllm.distributed.device_communicators import cuda_communicator as cu
    except Exception:  # noqa: BLE001
        return
    orig = cu.CudaCommunicator.all_reduce

    @functools.wraps(orig)
    def all_reduce(self, input_, *a, **kw):
        if not _STATE.get("eager") or torch.cuda.is_current_stream_capturing():
            return orig(self, input_, *a, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = orig(self, input_, *a, **kw)
        end.record()
        ws.cuda_pending.append((start, end, time.time(), int(input_.numel() * input_.element_size())))
        return out

    cu.CudaCommunicator.all_reduce = all_reduce


def _profile_every() -> int:
    try:
        return max(int(os.environ.get("TTFTSCOPE_PROFILE_EVERY", "0")), 0)
    except ValueError:
        return 0


@_guard("profile_now")
def _profile_now(ws: _WorkerState) -> bool:
    """Every TTFTSCOPE_PROFILE_EVERY-th step runs under torch.profiler (off by default)."""
    if not ws.profile_every:
        return False
    ws.calls += 1
    return ws.calls % ws.profile_every == 0


def _profiled(ws: _WorkerState, orig, *args, **kw):
    """One step under torch.profiler: the collectives it records become sampled
    ``allreduce.call`` spans. This is how collectives inside CUDA graphs or compiled code
    (where no Python hook runs) are seen; the profile is parsed on a background thread.
    Any profiler failure turns sampling off and the step runs as usual."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts)
        prof.__enter__()
    except Exception:  # noqa: BLE001
        ws.profile_every = 0
        log.exception("ttftscope: torch.profiler unavailable; sampled collective windows are off")
        return orig(*args, **kw)
    wall0 = time.time()
    try:
        return orig(*args, **kw)
    finally:
        try:
            prof.__exit__(None, None, None)
            threading.Thread(target=_emit_profiled_collectives, name="ttftscope-profile",
                             args=(prof, wall0, ws.step, ws.rank, ws.tp, ws.engine), daemon=True).start()
        except Exception:  # noqa: BLE001
            ws.profile_every = 0
            log.exception("ttftscope: profiler window failed; sampled collective windows are off")


def _is_collective(name: str) -> bool:
    n = name.lower()
    return "allreduce" in n or "all_reduce" in n


@_guard("profiled_collectives")
def _emit_profiled_collectives(prof, wall0: float, step, rank, tp, engine: str) -> None:
    evts = prof.events()
    if not evts:
        return
    t_first = min(e.time_range.start for e in evts)  # the step's first recorded op ~ wall0
    found = [e for e in evts if _is_collective(e.name)]
    device = [e for e in found if str(getattr(e, "device_type", "")).endswith("CUDA")]
    if device:  # kernels on the GPU: their time is the collective's
        calls = device
    else:  # CPU ops: the outermost collective op of each nest
        def nested(e) -> bool:
            p = e.cpu_parent
            while p is not None:
                if _is_collective(p.name):
                    return True
                p = p.cpu_parent
            return False
        calls = [e for e in found if not nested(e)]
    for e in calls:
        start = wall0 + (e.time_range.start - t_first) / 1e6
        _span(SpanName.ALLREDUCE_CALL, start, start + (e.time_range.end - e.time_range.start) / 1e6, {
            Attr.STEP: step if step is not None else -1, Attr.RANK: rank, Attr.TP_SIZE: tp, Attr.SAMPLED: True,
            Attr.PHASE: "allreduce", Attr.COLLECTIVE: e.name, Attr.ENGINE: engine})


@_guard("allreduce")
def _on_allreduce(ws: _WorkerState, input_, wall: float, dt: float) -> None:
    ws.count += 1
    ws.bytes += int(input_.numel() * input_.element_size())
    ws.time += dt
    if ws.first is None:
        ws.first = wall


@_guard("exec_start")
def _on_exec_start(ws: _WorkerState, scheduler_output, worker=None) -> None:
    if "eager" not in _STATE:  # per-call CUDA collective timing is only safe without graphs
        mc = getattr(worker, "model_config", None) or getattr(getattr(worker, "vllm_config", None), "model_config", None)
        _STATE["eager"] = bool(getattr(mc, "enforce_eager", False))
    ws.count, ws.bytes, ws.time, ws.first = 0, 0, 0.0, None
    ws.step = getattr(scheduler_output, "_ttftscope_step", None)
    if ws.rank is None:
        try:
            from vllm.distributed import parallel_state as ps

            ws.rank = ps.get_tensor_model_parallel_rank()
            ws.tp = ps.get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001
            ws.rank, ws.tp = 0, 1


@_guard("exec_end")
def _on_exec_end(ws: _WorkerState) -> None:
    # CUDA (eager only): read finished events without synchronising
    if ws.cuda_pending:
        still = []
        for e in ws.cuda_pending:
            if not e[1].query():
                still.append(e)
                continue
            ws.count += 1
            ws.bytes += e[3]
            ws.time += e[0].elapsed_time(e[1]) / 1e3
            ws.first = ws.first or e[2]
        ws.cuda_pending = still[-1024:]
    if ws.count == 0 or ws.first is None:
        return
    _span(SpanName.ALLREDUCE, ws.first, ws.first + ws.time, {
        Attr.STEP: ws.step if ws.step is not None else -1, Attr.RANK: ws.rank, Attr.TP_SIZE: ws.tp,
        Attr.ALLREDUCE_COUNT: ws.count, Attr.ALLREDUCE_BYTES: ws.bytes, Attr.PHASE: "allreduce",
        Attr.ENGINE: ws.engine})


_PROCESS_READY_EMITTED = {"done": False}


@_guard("process_ready")
def _emit_process_ready(role: str) -> None:
    if _PROCESS_READY_EMITTED["done"]:
        return
    _PROCESS_READY_EMITTED["done"] = True
    try:
        import psutil

        start = psutil.Process().create_time()
    except Exception:  # noqa: BLE001
        start = time.time()
    ws = _STATE.get("worker")
    tracer = _STATE["tracer"]
    if tracer is None:
        return
    from opentelemetry import trace as ot

    now = time.time()
    root = tracer.start_span(SpanName.PROCESS_START, start_time=int(start * 1e9), attributes={
        Attr.PHASE: "load", Attr.RANK: getattr(ws, "rank", None) if ws and ws.rank is not None else 0,
        "ttftscope.process.role": role})
    # interpreter start and imports (torch, vLLM) until vLLM loaded the plugin: no vLLM span covers it
    reg = _STATE.get("registered_at", now)
    _span(SpanName.LOAD, start, min(reg, now), {Attr.PHASE: "load", Attr.LOAD_STAGE: "process start and imports"},
          ot.set_span_in_context(root))
    root.end(end_time=int(now * 1e9))
