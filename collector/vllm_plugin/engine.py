"""Engine-core adapters: ``queue`` (queued -> first scheduled), one ``prefill`` span per
chunk, one ``step`` span per engine step (runs of decode-only steps merged), and the engine's
cold start (ready once the KV cache is allocated).

Quiet steps (decode only, nobody waiting, no prefill in progress: they cannot delay a first
token) are sampled: after ``TTFTSCOPE_QUIET_STEPS`` of them the scheduler *rests* (vLLM's own
methods bound on the instance shadow the wrappers: no Python of ours per step) until a request
arrives or the next second's sample; the stretch not watched is one ``unobserved`` span.

On the engine loop the hooks keep plain numbers and references only; the logged steps are
sorted out — a step's prompt chunks, cached tokens, intake and queue from the scheduler output's
own snapshots — and decode steps folded into runs off the loop: in the export sidecar, to which
the plugin's step-flush thread hands the log every second (``FOLD_EVERY_S``; :class:`StepSorter`),
or by that thread itself where there is no sidecar."""

from __future__ import annotations

import functools
import operator
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import (
    HANDOFF_HEADER,
    PREFIX_BLOCK,
    PREFIX_MAX_BLOCKS,
    Attr,
    ProcessRole,
    SpanName,
)

from .adapters import ENGINE, Internal, adapter
from .coldstart import emit_process_ready
from .config import FOLD_EVERY_S
from .runtime import (
    RT,
    at_exit,
    ext_id_of,
    guard,
    hot,
    log,
    sampled,
    set_model,
    span,
    timing_floor,
    turn_off,
)

_SCHED = "vllm.v1.core.sched.scheduler"
_REQ = "vllm.v1.request"


_INTAKE, _QUEUE, _PREFILL = Phase.INTAKE.value, Phase.QUEUE.value, Phase.PREFILL.value


#: one request's prompt tokens computed in one step (a tuple: many are made per second):
#: (request id, tokens computed, tokens from the prefix cache (first chunk only), chunk index,
#: trace headers, external id (the client's, when vLLM keeps it) or None, ``PrefixHashes`` of
#: the prompt (first chunk only) or None, the KV-cache block size (first chunk only: hits come
#: in whole blocks) or None, whether it is the first chunk after vLLM preempted the request)
Chunk = tuple


# Span attributes are built on the export thread (``DeferredSpans``' lazy ``(build, args)``):
# the engine-core threads keep the plain values these take.

def _intake_attrs(req_id: str, external: str | None, ipc_s: float | None) -> dict:
    attrs = {Attr.REQUEST_ID: ext_id_of(req_id, external), Attr.PHASE: _INTAKE}
    if ipc_s is not None:
        attrs[Attr.INTAKE_IPC_NS] = int(ipc_s * 1e9)
    return attrs


def _queue_attrs(req_id: str, external: str | None, priority) -> dict:
    return {Attr.REQUEST_ID: ext_id_of(req_id, external), Attr.PHASE: _QUEUE, Attr.PRIORITY: str(priority)}


def _prefill_attrs(c: Chunk, step: int, batch: int, engine: str) -> dict:
    req_id, tokens, cached, index, _th, external, ph, block_size, resumed = c
    attrs = {Attr.REQUEST_ID: ext_id_of(req_id, external), Attr.PHASE: _PREFILL, Attr.STEP: step,
             Attr.CHUNK: index, Attr.TOKENS_COMPUTED: tokens, Attr.TOKENS_CACHED: cached,
             Attr.BATCH_SIZE: batch, Attr.ENGINE: engine}
    if resumed:
        attrs[Attr.PREFILL_RESUMED] = True
    if block_size:
        attrs[Attr.KV_BLOCK_SIZE] = block_size
    if ph is not None:
        attrs[Attr.PREFIX_HASH] = ph
        attrs[Attr.PREFIX_CHAIN] = ph.chain
    return attrs


def _step_attrs(step: int, prefill_tokens: int, total: int, running: int, waiting: int, batch: int, engine: str,
                anatomy: tuple, max_num_seqs, recompute: int = 0) -> dict:
    attrs = {Attr.STEP: step, Attr.STEP_PREFILL_TOKENS: prefill_tokens,
             Attr.STEP_DECODE_TOKENS: max(total - prefill_tokens, 0), Attr.RUNNING: running, Attr.WAITING: waiting,
             Attr.BATCH_SIZE: batch, Attr.ENGINE: engine, **_anatomy_attrs(*anatomy)}
    if waiting:
        attrs[Attr.MAX_NUM_SEQS] = max_num_seqs
    if recompute:
        attrs[Attr.STEP_RECOMPUTE_TOKENS] = recompute
    return attrs


class PrefixHashes:
    """A prompt's prefix hashes, computed once when the span is encoded (``str()``, on the
    export thread): the chained hashes of its ``PREFIX_BLOCK``-token blocks (``chain``, up to
    ``PREFIX_MAX_BLOCKS``), the first of them standing for the prompt's first block. The step-flush
    thread keeps only a reference to vLLM's token list (which it does not change after the
    request is created; a longer prompt's reachable blocks are copied, so a queued span never
    holds more); when the export queue is backed up (the collector down), :meth:`freeze`
    computes them at once and lets the list go. Token ids hash the same in every process."""

    __slots__ = ("toks", "_hashes")

    def __init__(self, toks) -> None:
        cap = PREFIX_BLOCK * PREFIX_MAX_BLOCKS
        self.toks = toks if len(toks) <= cap else toks[:cap]
        self._hashes: list[str] | None = None

    @property
    def chain(self) -> _ChainOf:
        """All the block hashes, joined when encoded (made off the engine loop, when asked)."""
        return _ChainOf(self)

    def hashes(self) -> list[str]:
        if self._hashes is None:
            t, b, h, out = self.toks, PREFIX_BLOCK, 0, []
            for i in range(0, len(t) // b * b, b):
                h = hash((h, *t[i:i + b]))
                out.append(format(h & 0xFFFFFFFFFFFF, "x"))
            self._hashes, self.toks = out, ()
        return self._hashes

    def __reduce__(self):
        # handed to the export sidecar as a plain list of its whole blocks' ids: pickle writes a
        # list of ints in C (~4 us for 256 ids), less than converting it to an array of C ints
        # first costs (~6.5 us: ~22 ns an id; bench/handoff_frame.py); vLLM's own list type (or
        # a view) stays here
        if self._hashes is not None:
            return _prefix_hashes, ((), self._hashes)
        t = self.toks
        k = len(t) // PREFIX_BLOCK * PREFIX_BLOCK  # whole blocks are hashed
        whole = t if k == len(t) else t[:k]
        return _prefix_hashes, (whole if type(whole) is list else list(whole), None)

    def freeze(self) -> PrefixHashes:
        self.hashes()
        return self

    def __str__(self) -> str:
        return self.hashes()[0]


def _prefix_hashes(toks: list, hashes: list[str] | None) -> PrefixHashes:
    ph = PrefixHashes(toks)
    ph._hashes = hashes
    return ph


class _ChainOf:
    """The ``chain`` attribute's value: its prompt's block hashes, joined when encoded."""

    __slots__ = ("of",)

    def __init__(self, of: PrefixHashes) -> None:
        self.of = of

    def __str__(self) -> str:
        return ",".join(self.of.hashes())


#: what schedule() decided, until update_from_output() closes the step (a tuple: this is per step)
#: (step, t0, t1, admitted or None, running, waiting, resumed_reqs, finished): admitted, for a step
#: that may carry prompt tokens, is its new requests' ``(request id, Request, PrefillStats, tokens
#: computed before)`` (the id and the count read from vLLM's ``NewRequestData``, which is not kept);
#: None for a decode-only step; resumed_reqs: the requests it resumed after a preemption ``(request
#: id, its tokens, prompt and generated, if it was preempted in its decode, else 0)``, read on the
#: loop only in such a step; finished: for a step that may carry prompt tokens, vLLM's set of the
#: requests that finished or were aborted since the step before (``finished_req_ids``: a prefill in
#: progress ends there when its client went away), else None
PendingStep = tuple


@dataclass(slots=True)
class DecodeRun:
    """Consecutive decode-only steps merged into one span: all with nobody waiting, or all with
    requests waiting (then with the seats and how many steps held every one of them)."""

    start: float
    end: float
    steps: int
    decode_tokens: int
    running: int
    first: int
    last: int
    schedule: float  # anatomy, seconds summed over the run
    execute: float
    update: float
    idle: float
    hidden: float = 0.0  # host time that ran while the workers executed a step (async scheduling: ``_overlap``)
    waiting: int = 0  # the most requests waiting at any of its steps
    seats: int = 0  # vLLM's max_num_running_reqs, when requests waited
    full: int = 0  # steps in which requests waited and every seat was held


_RUN_FIELDS = operator.attrgetter(*DecodeRun.__slots__)  # the fields, in order (dataclass slots)

#: a step that may have carried prompt tokens, as the engine loop logs it: (``PendingStep``, its
#: SchedulerOutput's ``num_scheduled_tokens``, ``total_num_scheduled_tokens`` and the two lists of its
#: ``scheduled_cached_reqs`` read (``req_ids``, ``num_computed_tokens``), the scheduler, previous
#: step's t_u0, t_u0, t_u1, previous step's end); sorted out by ``_work_step``. Not the output
#: itself: held until the fold (up to a second), its whole object graph — which vLLM lets go when
#: the step closes — outlived collections of the youngest generation and made every one of them
#: dearer (bench/overhead's garbage-collection rows)
WorkStep = tuple

#: a prefill in progress with no chunk for this many steps, its request gone from vLLM: let go
#: (checked every this many steps, where vLLM's scheduler can be asked: in its process)
STALE_PREFILL_STEPS = 1024
#: prefills in progress remembered at most where vLLM's scheduler cannot be asked whether a request
#: is gone (the export sidecar's copy of the steps): one preempted mid-prefill may wait thousands of
#: steps for KV-cache blocks and come back; beyond this many, the longest without a chunk let go
PREFILLS_MAX = 4096

#: requests a sorter of handed-over steps remembers as queued already (:attr:`EngineState.seen`)
SEEN_MAX = 65_536

#: steps logged between folds at most (a second of watched steps): a bound, never reached while
#: the step-flush thread runs
STEP_LOG_MAX = 16_384

#: a run of decode steps ends (its span is made) once its last step closed this long ago
RUN_IDLE_S = 0.25

#: a decode-only step as the engine loop logs it (a tuple: one append per step): (step, t0, t1,
#: t_u0, t_u1, previous step's end, tokens scheduled, running, waiting, seats or 0)
DecodeStep = tuple

#: an engine-loop pause this long before a decode step with requests waiting starts a new run:
#: the idle time shows as a gap between step spans (analyzer.gaps: engine bubbles), not inside
#: a run (with nobody waiting, a pause cannot delay a first token: it stays in the run's idle)
RUN_SPLIT_IDLE_S = 0.002


@dataclass
class EngineState:
    step: int = 0
    pending: dict[int, PendingStep] = field(default_factory=dict)
    #: prefills in progress (sorted out off the loop): request id -> (its next chunk's index, vLLM's
    #: Request, the step of its last chunk)
    chunks: dict[str, tuple] = field(default_factory=dict)
    #: recomputes in progress (off the loop): a request preempted in its decode and resumed, its KV
    #: cache computed again -> (its tokens when resumed: the recompute ends there, and the step that
    #: ends it samples a new token; the step of its last chunk)
    recomputes: dict[str, tuple] = field(default_factory=dict)
    after_prompt: bool = False  # prompts in progress after the last step (vLLM's own set): the next step is kept
    pruned: int = 0  # the step at which prefills in progress were last checked for requests gone (``_let_go``)
    engine: str = field(default_factory=lambda: f"engine-{os.getpid()}")
    #: steps as the engine loop leaves them (``DecodeStep``, ``WorkStep``; None: the open run ends
    #: there; ``(start, end)``: a stretch of steps not watched), sorted out and folded into runs off the loop (:func:`fold_steps`: the step-flush
    #: thread, every ``FOLD_EVERY_S``)
    log: deque = field(default_factory=lambda: deque(maxlen=STEP_LOG_MAX))
    runs_lock: threading.Lock = field(default_factory=threading.Lock)  # decode_run and the folding
    decode_run: DecodeRun | None = None
    last_end: float = 0.0  # when the previous step's update_from_output returned
    #: when the previous step's update_from_output began (its output back from the workers): with
    #: async scheduling a step is scheduled while the one before it still runs, and the workers
    #: start it only then
    last_u0: float = 0.0
    stamp: bool = True  # the scheduler's output takes our step number (for the workers' spans; ``_decide_stamp``)
    # quiet steps (TTFTSCOPE_QUIET_STEPS): between samples the scheduler rests, running vLLM's own
    # methods (instance attributes that shadow our wrappers), and nothing of ours runs per step
    rest: tuple | None = None  # vLLM's (schedule, update_from_output); None: every step observed
    quiet_left: int = 0  # quiet steps still to observe before resting (refilled every sample)
    may_rest: bool | None = None  # decided once (``_may_rest``)
    wrappers: tuple = ()  # the class-level (schedule, update_from_output) wrappers the plugin installed
    resting: bool = False
    rested: object = None  # the scheduler resting (its shadowing attributes are removed on waking)
    gap_from: float = 0.0  # when the last observed step closed, while an unobserved stretch is open
    rest_lock: threading.Lock = field(default_factory=threading.Lock)
    #: where the steps are sorted out from handed-over copies (the export sidecar: :class:`StepSorter`),
    #: the requests whose queue span was made (a copy's first-schedule mark is not cleared in vLLM's
    #: process): request id -> None, the oldest let go past ``SEEN_MAX``; None in vLLM's process
    seen: dict | None = None
    shipped: bool = False  # the last hand-over carried steps (an empty one follows, once: the engine went idle)


ST = EngineState()


@adapter("scheduler", roles=ENGINE, what="queue, prefill chunks (tokens computed / from the prefix cache) and steps",
         internals=[Internal(_SCHED, "Scheduler.add_request"), Internal(_SCHED, "Scheduler.schedule"),
                    Internal(_SCHED, "Scheduler.update_from_output"),
                    Internal(_SCHED, "Scheduler.vllm_config", "attribute"),
                    Internal("vllm.config.parallel", "ParallelConfig.tensor_parallel_size", "attribute"),
                    Internal("vllm.config.compilation", "CompilationConfig.mode", "attribute"),
                    Internal("vllm.config.compilation", "CompilationConfig.cudagraph_mode", "attribute"),
                    Internal(_SCHED, "Scheduler.requests", "attribute"),
                    Internal(_SCHED, "Scheduler.running", "attribute"),
                    Internal(_SCHED, "Scheduler.waiting", "attribute"),
                    Internal(_SCHED, "Scheduler.max_num_running_reqs", "attribute"),
                    Internal(_SCHED, "Scheduler.block_size", "attribute"),
                    Internal("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", "attribute"),
                    Internal("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_new_reqs", "attribute"),
                    Internal("vllm.v1.core.sched.output", "SchedulerOutput.total_num_scheduled_tokens", "attribute"),
                    Internal("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_cached_reqs", "attribute"),
                    Internal("vllm.v1.core.sched.output", "SchedulerOutput.finished_req_ids", "attribute"),
                    Internal("vllm.v1.core.sched.output", "NewRequestData.req_id", "attribute"),
                    Internal("vllm.v1.core.sched.output", "NewRequestData.num_computed_tokens", "attribute"),
                    Internal("vllm.v1.core.sched.output", "CachedRequestData.req_ids", "attribute"),
                    Internal("vllm.v1.core.sched.output", "CachedRequestData.num_computed_tokens", "attribute"),
                    Internal("vllm.v1.core.sched.output", "CachedRequestData.resumed_req_ids", "attribute"),
                    Internal(_REQ, "Request.num_tokens", "attribute"),
                    Internal(_REQ, "Request.num_output_tokens", "attribute"),
                    Internal(_SCHED, "Scheduler._inflight_prefills", "attribute"),
                    Internal(_REQ, "Request.trace_headers", "attribute"),
                    Internal(_REQ, "Request.num_prompt_tokens", "attribute"),
                    Internal(_REQ, "Request.prompt_token_ids", "attribute"),
                    Internal(_REQ, "Request.priority", "attribute"),
                    Internal(_REQ, "Request.prefill_stats", "attribute"),
                    Internal("vllm.v1.metrics.stats", "PrefillStats.num_cached_tokens", "attribute"),
                    Internal("vllm.v1.metrics.stats", "PrefillStats.num_prompt_tokens", "attribute")])
def _install_scheduler() -> None:
    from vllm.v1.core.sched import scheduler as sched

    def flush_idle() -> None:  # hands the logged steps over (or sorts them out); a run ends when the engine goes idle
        from ..otel_setup import name_native_thread

        name_native_thread("ttftscope-flush")
        failed = False
        timed = bool(RT.config.self_timing_dir)  # this thread's CPU, for the plugin's own accounting
        ticks, driving = 0, True
        while True:
            exported = 0.0
            time.sleep(FOLD_EVERY_S)
            c0 = time.thread_time() if timed else 0.0
            ticks += 1
            try:
                sample_quiet(ST, RT.config.quiet_steps)
                steps_off_the_loop(ST)
            except Exception:  # noqa: BLE001 - keep folding (the log is bounded either way)
                if not failed:
                    failed = True
                    log.exception("ttftscope: sorting out the logged steps failed")
                with ST.runs_lock:
                    ST.log.clear()
                    ST.decode_run = None
            if driving:
                try:
                    exported = export_on_this_thread(RT.processor, ticks)  # (CPU counted as the export's)
                except Exception:  # noqa: BLE001 - the export thread takes the interval back, for good
                    driving = False
                    log.exception("ttftscope: exporting on the step-flush thread failed; the export thread exports")
                    if RT.processor is not None:
                        RT.processor.drive(False)
            if timed:
                RT.background_s += time.thread_time() - c0 - exported

    S = sched.Scheduler
    orig_add, orig_schedule, orig_update = S.add_request, S.schedule, S.update_from_output
    quiet = RT.config.quiet_steps
    if quiet is not None:
        ST.rest, ST.quiet_left = (orig_schedule, orig_update), quiet
    threading.Thread(target=flush_idle, name="ttftscope-step-flush", daemon=True).start()
    at_exit(lambda: steps_off_the_loop(ST, final=True))
    _hand_over_as_plain(sched.Scheduler)

    floor = timing_floor if RT.config.self_timing_dir else None
    live = [True]  # the step hooks (hot: no guard of their own): off, logged once, if one raises
    live_add = [True]  # the same for add_request's
    clock = time.time

    @functools.wraps(orig_add)
    def add_request(self, request):
        if live_add[0]:
            try:
                _on_add(request, clock())
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                turn_off(live_add, "add_request")
        return orig_add(self, request)

    both = " (with the other step hook)"

    @functools.wraps(orig_schedule)
    def schedule(self, *a, **kw):
        t0 = clock()
        out = orig_schedule(self, *a, **kw)
        if live[0]:
            try:
                _on_schedule(ST, self, out, t0, clock())
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                turn_off(live, "schedule", both)
        if floor is not None:
            floor(ST, self, out, t0, t0)
        return out

    @functools.wraps(orig_update)
    def update_from_output(self, scheduler_output, *a, **kw):
        t_u0 = clock()
        try:
            return orig_update(self, scheduler_output, *a, **kw)
        finally:
            if live[0]:
                try:
                    _on_step_done(ST, self, scheduler_output, t_u0, clock())
                except Exception:  # noqa: BLE001
                    turn_off(live, "step", both)

    S.add_request, S.schedule, S.update_from_output = add_request, schedule, update_from_output
    ST.wrappers = (schedule, update_from_output)


@adapter("engine-ready", roles=ENGINE, what="the engine core's cold start (process start -> KV cache allocated); "
         "whether the workers need our step number",
         internals=[Internal("vllm.v1.engine.core", "EngineCore._initialize_kv_caches"),
                    Internal("vllm.v1.engine.core", "EngineCore.vllm_config", "attribute"),
                    Internal("vllm.config.model", "ModelConfig.served_model_name", "attribute"),
                    Internal("vllm.config.parallel", "ParallelConfig.tensor_parallel_size", "attribute"),
                    Internal("vllm.config.compilation", "CompilationConfig.mode", "attribute"),
                    Internal("vllm.config.compilation", "CompilationConfig.cudagraph_mode", "attribute")])
def _install_engine_ready() -> None:
    # the plugin runs inside EngineCore.__init__, before it allocates the KV cache: the
    # end of that allocation is when the engine can serve
    from vllm.v1.engine import core

    orig_kv = core.EngineCore._initialize_kv_caches

    @functools.wraps(orig_kv)
    def init_kv(self, *a, **kw):
        r = orig_kv(self, *a, **kw)
        _name_model(self)
        _decide_stamp(self)
        emit_process_ready(ProcessRole.ENGINE_CORE.value)
        return r

    core.EngineCore._initialize_kv_caches = init_kv


@guard("engine-model")
def _name_model(core) -> None:
    set_model(core.vllm_config.model_config.served_model_name)


@guard("engine-steps")
def _decide_stamp(core) -> None:
    """Whether the scheduler's outputs carry our step number to the workers: only where they
    time something per step under it (:func:`~.worker.workers_number_steps`); elsewhere (vLLM's
    default compiled mode without profiler windows) that is an attribute written on the engine
    loop every watched step, and pickled to every worker with TP > 1, for nothing. Decided once
    the engine's configuration is final (its KV cache allocated); until then, and if this fails,
    every output is stamped."""
    from .worker import model_runs_eagerly, workers_number_steps

    cfg = core.vllm_config
    ST.stamp = workers_number_steps(RT.config.profile_every, model_runs_eagerly(cfg),
                                    cfg.parallel_config.tensor_parallel_size)


#: the attribute the engine-input adapter leaves on vLLM's Request: when the input thread had it
RECEIVED = "_ttftscope_received"


@adapter("engine-input", roles=ENGINE,
         what="when the engine core's input thread has a request (splits intake into IPC and the wait for the "
              "engine loop)",
         internals=[Internal("vllm.v1.engine.core", "EngineCore.preprocess_add_request")])
def _install_engine_input() -> None:
    from vllm.v1.engine import core

    orig = core.EngineCore.preprocess_add_request

    live = [True]  # hot: no guard of its own; off, logged once, if it raises

    # (a resting scheduler is woken on the engine loop, when the request reaches it: ``_on_add``.
    # Woken here, the step in progress was watched to its end too, but the wake on this thread
    # cost ~12 us a call against ~4.5 on the loop: bench/overhead at 15 req/s, engine core's
    # hooks 30.4 -> 25.7 us a request)
    @functools.wraps(orig)
    def preprocess_add_request(self, request, *a, **kw):
        received = time.time()
        out = orig(self, request, *a, **kw)
        if live[0]:
            try:
                _stamp_received(out, received)
            except Exception:  # noqa: BLE001 - never let tracing hurt the server
                turn_off(live, "engine-input")
        return out

    core.EngineCore.preprocess_add_request = preprocess_add_request


@hot("engine-input")
def _stamp_received(out, received: float) -> None:
    """Once a request: when the engine core's input thread had it, on vLLM's Request (hot: its
    caller catches what it raises)."""
    req = out[0] if isinstance(out, tuple) else out  # (Request, wave) in vLLM 0.32
    object.__setattr__(req, RECEIVED, received)


#: the attribute the scheduler adapter leaves on vLLM's Request: when the scheduler had it (queued)
QUEUED = "_ttftscope_queued"


@hot("add_request")
def _on_add(request, now: float) -> None:
    """A request reaches the scheduler: when, stamped on vLLM's Request (one attribute; the
    intake and queue spans are made when it is first scheduled, from what it carries). Hot:
    its caller catches what it raises."""
    setattr(request, QUEUED, now)
    if ST.resting:
        wake(ST, now)


@hot("schedule")
def _on_schedule(st: EngineState, sched, out, t0: float, t1: float) -> None:
    """Runs on the engine loop every step, and keeps it to references and counters: a step
    that may carry prompt tokens (new requests scheduled, requests resumed after preemption, or
    a prefill still in progress after the step before: vLLM's own set of them) keeps its new
    requests' vLLM ``Request`` and ``PrefillStats`` objects (vLLM frees a request finished in
    this step and takes its stats when it reports them); which of its tokens were prompt
    tokens is sorted out off the loop, from the output's own snapshots (:func:`_prefill_work`,
    on the step-flush thread). Hot: its caller catches what it raises."""
    if st.gap_from:  # the first step watched after unobserved ones, since it was woken (``wake``)
        _unobserved(st, st.last_end)
    st.step = step = st.step + 1
    if st.stamp:  # the step travels with the output to the workers
        try:
            out._ttftscope_step = step
        except (AttributeError, TypeError):  # an output that takes no attribute: steps go unstamped
            st.stamp = False
    new = out.scheduled_new_reqs
    admitted = None
    # (a request preempted mid-prefill and resumed comes back among the cached requests, not
    # the new ones, and is no prefill in progress before its step: without the last test its
    # first resumed chunk was counted as decode tokens, seen on real vLLM with a small KV cache)
    resumed = out.scheduled_cached_reqs.resumed_req_ids
    resumed_reqs = ()
    finished = None
    if new or st.after_prompt or resumed:
        admitted = []
        finished = out.finished_req_ids  # (vLLM's own set, made anew every step)
        requests = sched.requests
        for n in new:
            r = requests.get(n.req_id)
            if r is not None:
                admitted.append((n.req_id, r, r.prefill_stats, n.num_computed_tokens))
        if resumed:  # (rare) back from a preemption: in its decode (its tokens: prompt and output are
            # recomputed, no first token waits), or in its prefill (0: the prefill goes on)
            resumed_reqs = tuple((i, r.num_tokens if r.num_output_tokens else 0) for i in resumed
                                 if (r := requests.get(i)) is not None)
    # prompts (or recomputes) still in progress after this step
    st.after_prompt = bool(sched._inflight_prefills)
    pending = st.pending
    pending[id(out)] = (step, t0, t1, admitted, len(sched.running), len(sched.waiting), resumed_reqs, finished)
    if len(pending) > 64:  # outputs that never came back (an aborted step): bounded
        del pending[next(iter(pending))]


def _prefill_work(st: EngineState, sched, ns: dict, cached_ids: list, cached_computed: list, admitted: list,
                  step: int, resumed_reqs: tuple = (), finished=None) -> tuple[list[Chunk], list[tuple], int] | None:
    """The prefill chunks of a step (``Chunk``), the requests scheduled for the first time
    ``(queued at, input thread had it or None, request id, external id, priority, trace
    headers)``, and its recomputed tokens (:func:`_recomputed`); None when there are none of
    them. Off the engine loop (the step-flush thread, in step order): the tokens each request
    had computed before the step are the output's own snapshots (``NewRequestData`` /
    ``CachedRequestData.num_computed_tokens``, read when the step was logged); a request's later
    chunks are those of a request whose prefill is in progress (``st.chunks``), until its last
    chunk, or until vLLM says it finished (``finished``: aborted mid-prefill) or it is let go
    (:func:`_let_go`)."""
    chunks, queued = [], []
    progress = st.chunks
    if finished and (progress or st.recomputes):
        for req_id in finished:
            progress.pop(req_id, None)
            st.recomputes.pop(req_id, None)
    if progress and step - st.pruned >= STALE_PREFILL_STEPS:
        _let_go(st, sched, step)
    todo = list(admitted)  # (request id, Request, PrefillStats, tokens computed before), as logged
    cached = dict(zip(cached_ids, cached_computed, strict=False)) if progress or resumed_reqs or st.recomputes \
        else None
    recompute = _recomputed(st, ns, cached, resumed_reqs, step) if cached is not None else 0
    # preempted in their prefill and back in this step: among the cached requests (vLLM's V1 model
    # runner), or new again (a request in progress scheduled as new): their next chunk says so
    again = {i for i, t in resumed_reqs if not t} | {t[0] for t in admitted if t[0] in progress} \
        if resumed_reqs or progress else ()
    if progress:  # prefills in progress: their next chunks, among the step's running requests (one
        # resumed after a preemption may be new again: then it is admitted)
        seen = {t[0] for t in todo}
        for req_id in cached_ids:
            got = progress.get(req_id)
            if got is not None and req_id not in seen:
                todo.append((req_id, got[1], None, cached[req_id]))
    for req_id, req, ps, prior in todo:
        th = req.trace_headers
        if not sampled(th):
            continue
        external = getattr(req, "external_req_id", None)
        q = getattr(req, QUEUED, None)
        if q is not None and st.seen is not None:  # a copy handed over: its first schedule, once
            if req_id in st.seen:
                q = None
            else:
                st.seen[req_id] = None
                if len(st.seen) > SEEN_MAX:
                    del st.seen[next(iter(st.seen))]
        if q is not None:  # its first schedule
            setattr(req, QUEUED, None)
            queued.append((q, getattr(req, RECEIVED, None), req_id, external, req.priority, th))
        n = ns.get(req_id)
        if n is None:
            continue
        prompt = req.num_prompt_tokens
        if prior >= prompt:  # not prompt tokens
            continue
        idx = progress[req_id][0] if req_id in progress else 0
        if prior + n < prompt:
            progress[req_id] = (idx + 1, req if req.__class__ is InPrefill else InPrefill(req, th, external), step)
        elif idx:  # its last chunk
            del progress[req_id]
        if idx:
            chunks.append((req_id, n, 0, idx, th, external, None, None, req_id in again))
            continue
        toks = req.prompt_token_ids
        # cached: vLLM's own count when it has one, else what was computed before
        chunks.append((req_id, n, ps.num_cached_tokens if ps is not None and ps.num_prompt_tokens else max(prior, 0),
                       0, th, external, PrefixHashes(toks) if toks is not None and len(toks) >= PREFIX_BLOCK else None,
                       sched.block_size, False))
    return (chunks, queued, recompute) if chunks or queued or recompute else None


class InPrefill:
    """What a prompt's later chunks read of its request (the first chunk read the rest): kept while
    its prefill is in progress, in place of vLLM's ``Request`` (or its plain copy) and its prompt."""

    __slots__ = ("trace_headers", "external_req_id", "num_prompt_tokens")

    def __init__(self, req, th, external) -> None:
        self.trace_headers, self.external_req_id, self.num_prompt_tokens = th, external, req.num_prompt_tokens


def _let_go(st: EngineState, sched, step: int) -> None:
    """Prefills in progress with no chunk for ``STALE_PREFILL_STEPS`` steps whose request vLLM's
    scheduler no longer has (aborted mid-prefill, its end not seen in a logged step) let go; checked
    now, later than ``step``'s own time, so a request gone now may still have chunks in steps logged
    after it, but not after so long a gap. Where the scheduler cannot be asked (the export sidecar's
    plain copy: ``requests`` None) a request preempted mid-prefill may be waiting for blocks: kept,
    up to ``PREFILLS_MAX`` (then those longest without a chunk go first)."""
    st.pruned = step
    progress, known = st.chunks, sched.requests
    if known is not None:
        for req_id in [i for i, (_, _, last) in progress.items() if step - last > STALE_PREFILL_STEPS and i not in known]:
            del progress[req_id]
    if len(progress) > PREFILLS_MAX:
        for req_id in sorted(progress, key=lambda i: progress[i][2])[:len(progress) - PREFILLS_MAX]:
            del progress[req_id]


def _recomputed(st: EngineState, ns: dict, cached: dict, resumed_reqs: tuple, step: int) -> int:
    """A step's recomputed tokens (off the loop): a request preempted in its decode lost its KV
    cache, and once resumed vLLM computes its prompt and the tokens it had generated again
    (less the whole blocks the prefix cache kept), perhaps over several steps. That is prompt-
    shaped work but no first token: counted in the step's prefill tokens (so the decode tokens
    are the tokens generated, as vLLM counts them), never in a request's prefill. The step that
    ends a recompute samples the request's next token: one of its tokens is decode."""
    rec = st.recomputes
    for req_id, tokens in resumed_reqs:
        if tokens:  # (0: preempted in its prefill, which goes on)
            rec[req_id] = (tokens, step)
    n_re = 0
    for req_id, (tokens, last) in list(rec.items()):
        n, before = ns.get(req_id), cached.get(req_id)
        if n is None or before is None:  # not in this step; aborted (long without a chunk): let go
            if step - last > STALE_PREFILL_STEPS:
                del rec[req_id]
            continue
        if before + n >= tokens:
            n_re += n - 1
            del rec[req_id]
        else:
            n_re += n
            rec[req_id] = (tokens, step)
    return n_re


def _anatomy_attrs(schedule: float, execute: float, update: float, idle: float, hidden: float = 0.0) -> dict:
    attrs = {Attr.STEP_SCHEDULE_NS: int(schedule * 1e9), Attr.STEP_EXECUTE_NS: int(execute * 1e9),
             Attr.STEP_UPDATE_NS: int(update * 1e9), Attr.STEP_IDLE_NS: int(idle * 1e9)}
    if hidden:  # (async scheduling only: sync steps carry the four as before)
        attrs[Attr.STEP_HOST_HIDDEN_NS] = int(hidden * 1e9)
    return attrs


@hot("step")
def _on_step_done(st: EngineState, sched, out, t_u0: float, t_u1: float) -> None:
    """A step closes: its prefill chunks end when its output reaches the scheduler (``t_u0``);
    its anatomy is schedule [t0, t1], execute (from :func:`_overlap`, off the loop: the previous
    step's ``t_u0`` is logged with it), update [t_u0, t_u1], and the idle time since the
    previous step closed. One append to the step log either way (a decode step's numbers, or
    a step that may carry prompt tokens with its output, sorted out off the loop:
    ``WorkStep``). Hot: its caller catches what it raises."""
    p = st.pending.pop(id(out), None)
    prev_end, prev_u0 = st.last_end, st.last_u0
    st.last_end, st.last_u0 = t_u1, t_u0
    if p is None:  # scheduled before the hooks were on (or woken mid-step: the unobserved end here)
        if st.gap_from:
            _unobserved(st, t_u1)
        return
    if p[3] is not None:
        c = out.scheduled_cached_reqs
        st.log.append((p, out.num_scheduled_tokens, out.total_num_scheduled_tokens, c.req_ids, c.num_computed_tokens,
                       sched, prev_u0, t_u0, t_u1, prev_end))
        if st.rest is not None and not p[5] and not st.after_prompt and st.quiet_left <= 0:
            _rest(st, sched, t_u1)  # the prompts are in, nobody waits: the steps to come are quiet
        return
    # a decode-only step: logged as it is (one append), merged into runs off the engine loop
    # (fold_steps); requests waiting and nothing scheduled: no span, the open run ends
    total = out.total_num_scheduled_tokens
    waiting = p[5]
    if total:
        st.log.append((p[0], p[1], p[2], prev_u0, t_u0, t_u1, prev_end, total, p[4], waiting,
                       sched.max_num_running_reqs if waiting else 0))
    elif waiting:
        st.log.append(None)
    if not waiting and st.rest is not None:  # a quiet step: enough of them watched, rest
        st.quiet_left -= 1
        if st.quiet_left <= 0:
            _rest(st, sched, t_u1)


def _may_rest(st: EngineState, sched) -> bool:
    """Whether steps may go unobserved: not when the workers number their steps for their own
    spans (collectives timed per call: an eager model with TP > 1; profiler windows), whose
    step numbers must then be the engine's, every one; and not when the scheduler's class does
    not reach ``schedule`` / ``update_from_output`` straight through the plugin's wrappers (a
    subclass that overrides one, as vLLM's ``DiffusionScheduler`` does ``schedule``, or another
    plugin's wrapper around ours): resting binds vLLM's base methods on the instance, which
    would skip that override — every step is watched there instead."""
    from .worker import model_runs_eagerly, workers_number_steps

    cls = type(sched)
    if (getattr(cls, "schedule", None), getattr(cls, "update_from_output", None)) != st.wrappers:
        log.info("ttftscope: %s.%s has a schedule/update_from_output of its own; every engine step is observed",
                 cls.__module__, cls.__qualname__)
        return False
    cfg = sched.vllm_config
    return not workers_number_steps(RT.config.profile_every, model_runs_eagerly(cfg),
                                    cfg.parallel_config.tensor_parallel_size)


def _rest(st: EngineState, sched, end: float) -> None:
    """Enough quiet steps watched: from the next step the scheduler runs vLLM's own methods
    (bound on the instance, they shadow our class-level wrappers) until :func:`wake`. The
    open run ends here; the unobserved stretch starts at ``end``. Not while a step with work is
    in flight (async scheduling), and never where :func:`_may_rest` says no."""
    with st.rest_lock:
        try:
            if st.may_rest is None:
                st.may_rest = _may_rest(st, sched)
            if not st.may_rest or st.resting:
                return
            pending = st.pending
            if pending and any(q[3] is not None or q[5] for q in pending.values()):
                return
            pending.clear()  # quiet steps already scheduled: part of the unobserved stretch
            schedule, update = st.rest
            sched.schedule = schedule.__get__(sched)
            sched.update_from_output = update.__get__(sched)
        except Exception:  # noqa: BLE001 - a scheduler that cannot rest: every step watched
            st.rest = None
            _unshadow(sched)
            log.warning("ttftscope: the scheduler cannot rest between quiet steps; every step is observed",
                        exc_info=True)
            return
        st.rested, st.resting, st.gap_from = sched, True, end
        st.log.append(None)  # the open run ends: the next steps are not watched


def wake(st: EngineState, now: float) -> None:
    """Watch every step again (a request came, or it is time for a sample): the scheduler's
    shadowing methods are removed, so its next call reaches our wrappers. The stretch not
    watched becomes one ``unobserved`` span at the first hooked call: to the end of the step
    in progress, or (the loop between steps: a request reaching the scheduler) to ``now``. The
    engine loop (``_on_add``) or the step-flush thread (a sample), inside a hook's guard."""
    with st.rest_lock:
        if not st.resting:
            return
        st.resting = False
        _unshadow(st.rested)
        st.last_end = now


def _unshadow(sched) -> None:
    """The scheduler's own methods bound on it (by :func:`_rest`) removed: our wrappers run again."""
    d = getattr(sched, "__dict__", {})
    d.pop("schedule", None)
    d.pop("update_from_output", None)




def sample_quiet(st: EngineState, quiet_steps: int | None) -> None:
    """Every ``FOLD_EVERY_S`` (the step-flush thread): the next ``quiet_steps`` quiet steps are
    watched in a row, a sample of the engine's decode steps (their anatomy, the decode step
    period): one wake-up and one rest a second, however many steps the sample takes."""
    if st.rest is None or quiet_steps is None:
        return
    st.quiet_left = quiet_steps
    if st.resting and quiet_steps:
        wake(st, time.time())


def _unobserved(st: EngineState, end: float) -> None:
    """The unobserved stretch closes at ``end``: logged as ``(start, end)`` (one append on the
    engine loop), made a span off the loop (:func:`fold_steps`)."""
    start, st.gap_from = st.gap_from, 0.0
    if end > start:
        st.log.append((start, end))


def _unobserved_attrs(engine: str) -> dict:
    return {Attr.ENGINE: engine}


def _work_step(st: EngineState, w: WorkStep):
    """A step that may have carried prompt tokens, sorted out off the loop: with prefill work
    or requests first scheduled, its spans (built on the export thread) and None (the open
    run ends before it); without, the ``DecodeStep`` it was, None (requests waited and
    nothing was scheduled: the run ends) or ``()`` (nothing to log)."""
    (step, t0, t1, admitted, running, waiting, resumed_reqs, finished), ns, total, cached_ids, cached_computed, sched, \
        prev_u0, t_u0, t_u1, prev_end = w
    work = _prefill_work(st, sched, ns, cached_ids, cached_computed, admitted, step, resumed_reqs, finished)
    if work is None:
        if total:
            return (step, t0, t1, prev_u0, t_u0, t_u1, prev_end, total, running, waiting,
                    sched.max_num_running_reqs if waiting else 0)
        return None if waiting else ()
    d = RT.deferred  # several spans in one record: DeferredSpans.group
    if d is not None:
        d.group(_step_spans, (step, t0, t1, prev_u0, t_u0, t_u1, work, len(ns), running, waiting,
                              total, st.engine, prev_end, sched.max_num_running_reqs if waiting else None),
                _let_prompts_go)
    return None


#: where a step's ``(chunks, queued)`` is in the arguments of its :func:`_step_spans` record
WORK_ARG = 6


def _let_prompts_go(args: tuple) -> None:
    """The export queue is backed up (it may hold a step's spans a long time): its prompts'
    prefix hashes computed now and the prompts let go (before the spans are queued)."""
    for c in args[WORK_ARG][0]:
        if c[6] is not None:
            c[6].freeze()


def _overlap(t0: float, t1: float, prev_u0: float, prev_end: float) -> tuple[float, float]:
    """(when a step scheduled at [t0, t1] began executing, the host time hidden behind a step in
    flight), from the previous step's update [prev_u0, prev_end]. The workers run the steps in
    order: a step scheduled while the one before it still ran (async scheduling, vLLM's default
    on GPU, a batch queue of two) executes from when that one is back, not from its own schedule
    -- its wait in the queue is not execution, and its prefill chunks' span does not cover the
    chunk before. Its schedule then ran behind the step before, and the previous step's update
    behind it: neither kept a worker waiting. Synchronous steps: (t1, 0)."""
    if prev_u0 > t1:
        return prev_u0, (t1 - t0) + (prev_end - prev_u0)
    return t1, 0.0


def _step_spans(step: int, t0: float, t1: float, prev_u0: float, t_u0: float, t_u1: float, work, batch: int,
                running: int, waiting: int, total: int, engine: str, prev_end: float, max_num_seqs) -> list[tuple]:
    """A step with prefill work or requests first scheduled, as spans (on the export thread):
    the intake and queue waits of the requests it scheduled first (queue: from when the
    scheduler had them to this schedule), its prefill chunks (execute: from :func:`_overlap`
    to ``t_u0``), and the step itself (its anatomy: schedule [t0, t1], execute, update
    [t_u0, t_u1], idle since ``prev_end``, host time hidden behind a step in flight)."""
    x0, hidden = _overlap(t0, t1, prev_u0, prev_end)
    out = []
    chunks, queued, recompute = work or ((), (), 0)
    for q, rx, req_id, external, priority, headers in queued:
        sent = float(headers.get(HANDOFF_HEADER) or "inf")  # the API server's handoff (trace-context adapter)
        if sent < q:  # intake: handoff -> the scheduler has it (IPC + loop wait)
            out.append((SpanName.INTAKE, sent, q,
                        _intake_attrs(req_id, external, rx - sent if rx is not None and sent <= rx <= q else None),
                        headers))
        out.append((SpanName.QUEUE, q, t0, _queue_attrs(req_id, external, priority), headers))
    for c in chunks:
        out.append((SpanName.PREFILL, x0, t_u0, _prefill_attrs(c, step, batch, engine), c[4]))
    if total:
        prefill_tokens = sum(c[1] for c in chunks) + recompute
        anatomy = (t1 - t0, max(t_u0 - x0, 0.0), t_u1 - t_u0, max(t0 - prev_end, 0.0) if prev_end else 0.0, hidden)
        out.append((SpanName.STEP, t0, t_u1, _step_attrs(step, prefill_tokens, total, running, waiting, batch, engine,
                                                          anatomy, max_num_seqs, recompute), None))
    return out


def fold_steps(st: EngineState) -> None:
    """Fold the steps the engine loop logged, in order (with ``st.runs_lock`` held): a step
    that may have carried prompt tokens is sorted out first (:func:`_work_step`); consecutive
    decode-only steps merge into one run, all with nobody waiting or all with requests waiting
    (then with the seats and how many steps held every one of them); a run ends where the other
    kind begins, where a waiting run's loop idled ``RUN_SPLIT_IDLE_S``, at a step with prefill
    work, and after 512 steps or a second."""
    log, engine = st.log, st.engine
    r = st.decode_run
    while log:
        d = log.popleft()
        if d is not None and len(d) < 11:
            if len(d) == 2:  # an unobserved stretch (the open run ended at the rest before it)
                span(SpanName.UNOBSERVED, d[0], d[1], (_unobserved_attrs, (engine,)))
                continue
            d = _work_step(st, d)  # a WorkStep
            if d == ():
                continue
        if d is None:
            if r is not None:
                _emit_run(r, engine)
                r = None
            continue
        step, t0, t1, prev_u0, t_u0, t_u1, prev_end, total, running, waiting, seats = d
        x0, hidden_s = _overlap(t0, t1, prev_u0, prev_end)
        sched_s, exec_s, upd_s = t1 - t0, max(t_u0 - x0, 0.0), t_u1 - t_u0
        idle_s = max(t0 - prev_end, 0.0) if prev_end else 0.0
        full = 1 if waiting and running >= seats else 0
        if r is None or (r.waiting > 0) != (waiting > 0) or (waiting and idle_s >= RUN_SPLIT_IDLE_S):
            if r is not None:
                _emit_run(r, engine)
            r = DecodeRun(t0, t_u1, 1, total, running, step, step, sched_s, exec_s, upd_s, idle_s, hidden_s, waiting,
                          seats, full)
            continue
        r.end, r.last, r.steps, r.decode_tokens = t_u1, step, r.steps + 1, r.decode_tokens + total
        if running > r.running:
            r.running = running
        if waiting > r.waiting:
            r.waiting = waiting
        r.full += full
        r.schedule += sched_s
        r.execute += exec_s
        r.update += upd_s
        r.idle += idle_s
        r.hidden += hidden_s
        if r.steps >= 512 or t_u1 - r.start > 1.0:
            _emit_run(r, engine)
            r = None
    st.decode_run = r


def flush_decode_run(st: EngineState, idle_s: float | None = None, now: float | None = None) -> None:
    """Fold what the engine loop logged, then end the open run: always, or (``idle_s``) only
    when its last step closed that long before ``now`` (default: the clock; a run ends when the
    engine goes idle, too)."""
    with st.runs_lock:
        fold_steps(st)
        r = st.decode_run
        if r is None or (idle_s is not None and (time.time() if now is None else now) - r.end < idle_s):
            return
        st.decode_run = None
    _emit_run(r, st.engine)


def _emit_run(r: DecodeRun, engine: str) -> None:
    # the run as a plain tuple of its fields: a third of a dataclass's cost to hand to the export sidecar
    span(SpanName.STEP, r.start, r.end, (_run_attrs, (_RUN_FIELDS(r), engine)))


def _run_attrs(r: DecodeRun | tuple, engine: str) -> dict:
    if r.__class__ is tuple:
        r = DecodeRun(*r)
    attrs = {Attr.STEP: r.first, Attr.STEP_LAST: r.last, Attr.STEP_COUNT: r.steps, Attr.STEP_PREFILL_TOKENS: 0,
             Attr.STEP_DECODE_TOKENS: r.decode_tokens, Attr.RUNNING: r.running, Attr.WAITING: r.waiting,
             Attr.ENGINE: engine, **_anatomy_attrs(r.schedule, r.execute, r.update, r.idle, r.hidden)}
    if r.waiting:
        attrs[Attr.MAX_NUM_SEQS] = r.seats
        attrs[Attr.STEP_FULL] = r.full
    return attrs


# --- the logged steps sorted out in the export sidecar ------------------------------------------
# Sorting the logged steps out and folding decode steps into runs cost the engine core's
# step-flush thread more CPU than any hook (bench/overhead: ~33 us a request, against ~39 for
# all the engine core's hooks together), in vLLM's process and under its GIL. Where the export
# goes through a sidecar (collector.handoff) the thread only hands the log over as it is, once a
# second: vLLM's objects in it (its Request, PrefillStats, scheduler) are written as the plain
# values the sorting reads (``plain_as``: on the export thread, as the frame is written) and the
# sidecar runs the same sorting (:class:`StepSorter`) as the frames arrive.


def ships() -> bool:
    """Whether this process's spans leave through an export sidecar (it is not known to be broken)
    that sorts its logged steps out (``TTFTSCOPE_STEPS_IN_SIDECAR``, on by default): then they are
    handed over as they are (:func:`ship_steps`), else sorted out here."""
    link = getattr(RT.processor, "link", None)
    return link is not None and not link.broken and RT.config.steps_in_sidecar


def export_on_this_thread(proc, ticks: int) -> float:
    """The step-flush thread, which wakes every ``FOLD_EVERY_S`` anyway, exports the engine core's
    spans on the export interval (every ``interval_s / FOLD_EVERY_S``-th tick: no more posts than
    before) while they go to an export sidecar (a pipe write; a post to the collector from here
    only if the sidecar breaks on the way): the export thread then wakes only for a full batch or
    a flush, one thread's wake-ups a second fewer, and the steps just handed over are pickled
    right away (bench/overhead: export + step-flush threads 41 -> 35-39 us a request)."""
    if not ships():  # no sidecar (or it broke): posts may block, the export thread's own work
        if proc is not None:
            proc.drive(False)
        return 0.0
    proc.drive(True)
    if ticks % max(round(proc.interval_s / FOLD_EVERY_S), 1):
        return 0.0
    return proc.export_due()


def steps_off_the_loop(st: EngineState, final: bool = False) -> None:
    """The step-flush thread's work each second (``final``: at exit, every open run ends): the
    logged steps handed to the sidecar (:func:`ship_steps`) or, without one, sorted out here."""
    if ships():
        ship_steps(st, final)
    else:
        flush_decode_run(st, idle_s=None if final else RUN_IDLE_S)


def ship_steps(st: EngineState, final: bool = False) -> None:
    """The step-flush thread's work where there is a sidecar: the steps logged since the last
    time, as one record (``DeferredSpans.steps``), and once an empty one when the engine went
    idle (the open run's end is decided where the steps are sorted out, as here, from when they
    were taken). ``final``: at exit, the open run ends."""
    log = st.log
    items = [log.popleft() for _ in range(len(log))]
    if not items and not st.shipped and not final:
        return
    st.shipped = bool(items)
    d = RT.deferred
    if d is not None:
        d.steps(st.engine, items, time.time(), final)


class PlainRequest:
    """What the sorting reads of vLLM's ``Request``, handed over (``_plain_request``)."""

    __slots__ = ("trace_headers", "external_req_id", QUEUED, RECEIVED, "priority", "num_prompt_tokens",
                 "prompt_token_ids")

    def __init__(self, *values) -> None:
        for k, v in zip(self.__slots__, values, strict=True):
            setattr(self, k, v)


class PlainStats:
    """What the sorting reads of vLLM's ``PrefillStats``."""

    __slots__ = ("num_cached_tokens", "num_prompt_tokens")

    def __init__(self, cached: int, prompt: int) -> None:
        self.num_cached_tokens, self.num_prompt_tokens = cached, prompt


class PlainScheduler:
    """What the sorting reads of vLLM's scheduler (``requests`` is not handed over, None: whether a
    request is gone is not known here, :func:`_let_go`)."""

    __slots__ = ("block_size", "max_num_running_reqs", "requests")

    def __init__(self, block_size, max_num_running_reqs) -> None:
        self.block_size, self.max_num_running_reqs, self.requests = block_size, max_num_running_reqs, None


def _plain_request(r) -> tuple:
    toks = r.prompt_token_ids
    if toks is not None:  # the whole blocks that are hashed, as a plain list (pickled in C)
        k = min(len(toks), PREFIX_BLOCK * PREFIX_MAX_BLOCKS) // PREFIX_BLOCK * PREFIX_BLOCK
        toks = toks[:k] if k < len(toks) else toks
        if type(toks) is not list:  # (vLLM's own list type, or a view)
            toks = list(toks)
    return PlainRequest, (r.trace_headers, getattr(r, "external_req_id", None), getattr(r, QUEUED, None),
                          getattr(r, RECEIVED, None), r.priority, r.num_prompt_tokens, toks)


def _plain_stats(ps) -> tuple:
    return PlainStats, (ps.num_cached_tokens, ps.num_prompt_tokens)


def _plain_scheduler(sched) -> tuple:
    return PlainScheduler, (sched.block_size, sched.max_num_running_reqs)


def _hand_over_as_plain(scheduler_cls: type) -> None:
    from vllm.v1.metrics.stats import PrefillStats
    from vllm.v1.request import Request

    from ..handoff import plain_as

    plain_as(Request, _plain_request)
    plain_as(PrefillStats, _plain_stats)
    plain_as(scheduler_cls, _plain_scheduler)


class StepSorter:
    """Engine cores' logged steps (``STEP_LOG`` records), sorted out where they are read: in the
    export sidecar as its frames arrive (or in the engine core before it encodes, when it has no
    sidecar any more), with the same code the step-flush thread runs in vLLM's process
    (:func:`flush_decode_run`), on each engine's own state: its prefills in progress, its open
    run. The spans go to the records' source."""

    def __init__(self) -> None:
        # (one thread reads: the sidecar's frame reader, or the serving process's export thread
        # under its drain lock: no lock of its own)
        self.engines: dict[str, tuple[EngineState, object]] = {}

    def __call__(self, src, records: list) -> list:
        from ..otel_setup import STEP_LOG

        out = []
        for r in records:
            if r[0] != STEP_LOG:
                out.append(r)
                continue
            engine, items, now, final = r[3]
            st = self._state(engine, src)
            st.log.extend(items)
            self._sorted(st, src, RUN_IDLE_S if not final else None, now)
        return out

    def _state(self, engine: str, src) -> EngineState:
        got = self.engines.get(engine)
        if got is None:
            got = self.engines[engine] = (EngineState(engine=engine, seen={}, stamp=False), src)
        return got[0]

    @staticmethod
    def _sorted(st: EngineState, src, idle_s: float | None, now: float | None) -> None:
        was, RT.deferred = RT.deferred, src
        try:
            flush_decode_run(st, idle_s=idle_s, now=now)
        finally:
            RT.deferred = was

    def finish(self) -> None:
        """The serving processes are gone: every open run ends."""
        for st, src in self.engines.values():
            self._sorted(st, src, None, None)


def _register_sorter() -> None:
    from ..otel_setup import READ_OUT, STEP_LOG

    READ_OUT.setdefault(STEP_LOG, StepSorter())


_register_sorter()
