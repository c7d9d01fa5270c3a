"""What every adapter of one process shares: its configuration, the span sink, the guard
that keeps a failing hook away from vLLM, sampling, and the plugin's own cost accounting."""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ttftscope.schemas.vocabulary import VOCABULARY_VERSION, Attr, ProcessRole, ResourceAttr

from .config import PluginConfig

log = logging.getLogger("vllm.ttftscope")


def mono_to_wall() -> float:
    """The offset from the monotonic clock (vLLM's engine timestamps; one clock for every process
    on a host) to the wall clock, read now: one taken at start-up is off by every step of the wall
    clock since (NTP, a VM's clock sync; 132 ms in one run on this VM)."""
    return time.time() - time.monotonic()


@dataclass
class Runtime:
    """The plugin's state in this process (one instance, ``RT``)."""

    config: PluginConfig
    role: str | None = None
    registered: bool = False
    registered_at: float = 0.0
    tracer: Any = None
    provider: Any = None
    processor: Any = None
    deferred: Any = None
    vllm_spans: Any = None  # vLLM's own request spans as plain records (the vllm-request-span adapter)
    exited: bool = False
    hooks_s: float = 0.0  # CPU of hook bodies (TTFTSCOPE_SELF_TIMING)
    hooks_wall_s: float = 0.0  # their wall time, GIL waits included
    hook_calls: int = 0
    background_s: float = 0.0  # CPU of the plugin's step-flush thread (TTFTSCOPE_SELF_TIMING): steps sorted out off the loop
    per_hook: dict = field(default_factory=dict)  # hook name -> [calls, CPU seconds]


RT = Runtime(PluginConfig.from_env())  # configuration is read once, at import


def turn_off(live: list, name: str, also: str = "") -> None:
    """A hook raised: ``live[0] = False`` (its caller checks it before every call) and the
    failure logged with its traceback, once. Call it in the ``except`` block that caught."""
    live[0] = False
    log.exception("ttftscope: hook %s failed and is now disabled%s", name, also)


def guard(name: str):
    """Decorator for hook bodies: any exception disables that hook, logged once."""
    def deco(fn):
        live = [True]

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if not live[0]:
                return None
            try:
                return fn(*a, **kw)
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                turn_off(live, name)
                return None

        return _timed(name, wrapper)
    return deco


def hot(name: str):
    """Decorator for hook bodies on hot paths (every engine step; once a request on the engine
    loop or the API server's event loop): no wrapper of its own, so nothing but the body runs —
    a call layer is ~1.3 µs of CPU with cold caches, several on a loop whose caches the model's
    step has just emptied. Its caller catches what it raises and turns it
    off (:func:`turn_off`), as :func:`guard` would. Timed as guard's when self-timing is on."""
    def deco(fn):
        return _timed(name, fn)
    return deco


def _timed(name: str, fn):
    """``fn`` itself, or (TTFTSCOPE_SELF_TIMING) ``fn`` timed as hook ``name``."""
    if not RT.config.self_timing_dir:
        return fn
    mine = RT.per_hook.setdefault(name, [0, 0.0])

    @functools.wraps(fn)
    def timed(*a, **kw):
        # the hook's CPU (this thread's) and its wall time: the difference is time it waited
        # for the GIL (another thread of this process running Python), not work of its own
        c, t = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            RT.hooks_wall_s += time.perf_counter() - t
            cpu = time.thread_time() - c
            RT.hooks_s += cpu
            RT.hook_calls += 1
            mine[0] += 1
            mine[1] += cpu
    return timed


def span(name: str, start_s: float, end_s: float, attrs: dict, parent=None) -> None:
    """Record a finished span (an O(1) append; the export thread builds and encodes it).
    ``parent``: the request's trace headers, an OpenTelemetry Context, or None."""
    d = RT.deferred
    if d is not None:
        d.add(name, start_s, end_s, attrs, parent)


@hot("timing_floor")
def timing_floor(*_a) -> None:
    """A hook that does nothing, timed like the others (TTFTSCOPE_SELF_TIMING only): what the
    accounting itself costs per call in this process, under its load (a thread-CPU clock read
    is a system call), so a report can subtract it. No guard of its own (``hot``): a guard
    is a layer of the hooks that have one, part of their cost, and the hot hooks have none —
    a floor with one would take it from them too."""


def sampled(trace_headers) -> bool:
    tp = (trace_headers or {}).get("traceparent", "")
    return len(tp) >= 55 and tp[-2:] != "00"


def new_traceparent() -> str:
    flags = "01" if random.random() < RT.config.sample_ratio else "00"
    return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64) or 1:016x}-{flags}"


_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def ext_id_of(request_id: str, external: str | None) -> str:
    """The request id the client and the API server see: vLLM's ``external_req_id`` where its
    request has one, else the engine's id without the random suffix it adds."""
    return external or _INTERNAL_SUFFIX.sub("", request_id)


def _poster(cfg: PluginConfig):
    """The plugin's lean OTLP/HTTP poster; None (the SDK exporter's client) if it cannot be made."""
    from ..span_wire import OtlpHttpPoster


    try:
        return OtlpHttpPoster(cfg.endpoint, timeout=cfg.export_timeout_s)
    except Exception as e:  # noqa: BLE001
        log.warning("ttftscope: exporting through the OpenTelemetry SDK's client (%s)", e)
        return None


def stopped_by_a_manager(role: str) -> bool:
    """Whether one of vLLM's process managers stops this process at a shutdown (and, with vLLM's
    default ``--shutdown-timeout 0``, force-kills it at once): an engine core, a worker, or one
    of the API servers a launcher started (``vllm serve --api-server-count N``: ``ApiServer_<i>``)."""
    return (role in (ProcessRole.ENGINE_CORE.value, ProcessRole.WORKER.value)
            or multiprocessing.current_process().name.startswith("ApiServer"))


def setup_otel(role: str) -> None:
    """OTLP/HTTP to the collector for this process; vLLM's own spans share the pipeline."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from ..otel_setup import BoundedBatchSpanProcessor, DeferredSpans

    cfg = RT.config
    # vLLM's own tracing exports with these: make it speak OTLP/HTTP to the same endpoint
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", cfg.endpoint)
    os.environ.setdefault("OTEL_SERVICE_NAME", "vllm")
    attrs = {
        ResourceAttr.ROLE: role,
        ResourceAttr.PROCESS_PID: os.getpid(),
        ResourceAttr.SERVICE_INSTANCE: f"{role}-{os.getpid()}",
        Attr.SCHEMA_VERSION: VOCABULARY_VERSION,
    }
    if cfg.run:
        attrs[ResourceAttr.RUN] = cfg.run
    resource = Resource.create(attrs)
    provider = TracerProvider(resource=resource)
    exporter = OTLPSpanExporter(endpoint=cfg.endpoint, timeout=cfg.export_timeout_s)
    kw = {"max_queue": cfg.max_queue, "max_batch": cfg.max_batch, "interval_s": cfg.interval_s, "poster": _poster(cfg)}
    if cfg.export_process:  # built, encoded and posted by an export sidecar (collector.handoff)
        from ..handoff import HandoffProcessor

        # the sidecar of a process vLLM may force-kill at once: at a shutdown it only hands over to it
        proc = HandoffProcessor(exporter, role=role, endpoint=cfg.endpoint, timeout_s=cfg.export_timeout_s,
                                start_now=stopped_by_a_manager(role), linger_s=cfg.export_linger_s, **kw)
    else:
        proc = BoundedBatchSpanProcessor(exporter, **kw)
    provider.add_span_processor(proc)
    if not hasattr(trace.get_tracer_provider(), "add_span_processor"):
        # no SDK provider yet: ours becomes the global one (for libraries that use it; vLLM
        # builds its own provider, which the vllm-tracer adapter points at this processor)
        trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("ttftscope.vllm", "0.1.0")
    deferred = DeferredSpans(tracer, resource, max_queue=cfg.max_queue, max_batch=cfg.max_batch)
    proc.add_source(deferred)
    RT.tracer, RT.processor, RT.provider, RT.deferred = tracer, proc, provider, deferred
    import atexit
    from multiprocessing import util as mp_util

    # vLLM's engine core and workers are multiprocessing children: a forked child leaves
    # through os._exit, which skips atexit but runs multiprocessing's finalizers
    atexit.register(on_exit)
    mp_util.Finalize(None, on_exit, exitpriority=100)


def _name_on_spans(attrs: dict, what: str) -> None:
    """Merge ``attrs`` into the resource of this process's span sources (the plugin's records and
    vLLM's ``llm_request``): records queued from now on carry them, those queued already keep the
    resource they were encoded with."""
    try:
        from opentelemetry.sdk.resources import Resource

        for d in (RT.deferred, RT.vllm_spans):
            if d is not None and d.resource is not None and any(d.resource.attributes.get(k) != v
                                                                for k, v in attrs.items()):
                d.resource = d.resource.merge(Resource(attrs))
                d._resource_attrs = None
    except Exception:  # noqa: BLE001 - a label is not worth hurting the server
        log.exception("ttftscope: could not name %s on this process's spans", what)


def set_model(name) -> None:
    """Name the served model on this process's spans (resource ``ttftscope.model``): vLLM's
    ``model_name`` metric label, so phase metrics group and join by model like vLLM's own.
    Called once a role learns it (API server args, engine/worker config)."""
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    if name:
        _name_on_spans({ResourceAttr.MODEL: str(name)}, "the model")


def claim_role(role: str) -> None:
    """This process is ``role`` by what vLLM does in it (it builds the OpenAI server's app: an
    API server), where its name and command line had not said (``other``: a launcher of the
    user's own, ``python my_server.py``). The plugin's records queued from now on carry it, vLLM's
    ``llm_request`` included (vLLM's start-up spans, made already, keep what they had); its export
    sidecar, if not started yet, starts under it. A role already known stays."""
    if RT.role not in (None, ProcessRole.OTHER.value) or role == RT.role:
        return
    RT.role = role
    _name_on_spans({ResourceAttr.ROLE: role, ResourceAttr.SERVICE_INSTANCE: f"{role}-{os.getpid()}"}, "the role")
    link = getattr(RT.processor, "link", None)  # the export sidecar's, not started yet: under the role
    if link is not None and getattr(link, "proc", None) is None:
        link.role = role
    log.info("ttftscope: this process serves vLLM's OpenAI API: role %s", role)


_EXIT_HOOKS: list = []


def at_exit(fn) -> None:
    """Run ``fn`` before the last export at process exit (e.g. an open run of steps)."""
    _EXIT_HOOKS.append(fn)


def reset_exit_hooks() -> None:
    """A forked child's: the parent's exit hooks (its open run of steps) are not its own."""
    _EXIT_HOOKS.clear()


def run_exit_hooks() -> None:
    """What this process holds but has not recorded yet (an open run of steps) recorded now:
    at exit, and when it is asked to hand its spans over (``handover``)."""
    for fn in _EXIT_HOOKS:
        try:
            fn()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def on_exit() -> None:
    if RT.exited:
        return
    RT.exited = True
    run_exit_hooks()
    try:
        if RT.processor is not None:
            RT.processor.shutdown()
    except Exception:  # noqa: BLE001
        pass


def write_every_second(out: Path, doc) -> None:
    """TTFTSCOPE_SELF_TIMING: ``doc(timing_cpu_s)`` written to ``out`` every second, for good.
    This thread's own CPU (the accounting's cost: ~1 ms a write on this VM) is passed in, so
    the document can report it apart from what it accounts."""
    out.parent.mkdir(parents=True, exist_ok=True)
    mine = 0.0
    while True:
        t = time.thread_time()
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc(mine)))
        os.replace(tmp, out)
        mine += time.thread_time() - t
        time.sleep(1.0)


def self_timing_writer(role: str) -> None:
    """TTFTSCOPE_SELF_TIMING: the plugin's own cost in this process, written every second."""
    def doc(mine: float) -> dict:
        proc = RT.processor
        return {"role": role, "pid": os.getpid(), "wall": time.time(), "process_cpu_s": time.process_time(),
                "timing_cpu_s": mine,
                "hooks_s": RT.hooks_s, "hooks_wall_s": RT.hooks_wall_s, "hook_calls": RT.hook_calls,
                "background_cpu_s": RT.background_s,
                "export_cpu_s": getattr(proc, "cpu_s", 0.0), "exported": getattr(proc, "exported", 0),
                "export_parts_s": dict(getattr(proc, "cpu_parts", {})), "export_posts": getattr(proc, "posts", 0),
                "per_hook": {k: list(v) for k, v in RT.per_hook.items()}}

    write_every_second(Path(RT.config.self_timing_dir) / f"{role}-{os.getpid()}.json", doc)


def start_self_timing(role: str) -> None:
    if RT.config.self_timing_dir:
        threading.Thread(target=self_timing_writer, args=(role,), name="ttftscope-self-timing", daemon=True).start()
