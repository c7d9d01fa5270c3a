"""The engine core's logged steps, sorted out and folded off the engine loop (the step-flush
thread, or the export sidecar: :mod:`.steps_handoff`): a step's prompt chunks, cached tokens,
intake and queue from the scheduler output's own snapshots (:func:`_prefill_work`), its spans
(:func:`_step_spans`), and decode-only steps merged into runs (:func:`fold_steps`). The shapes the
engine loop logs (``PendingStep``, ``WorkStep``, ``DecodeStep``) and the engine's state
(:class:`EngineState`) are defined here, with the attributes the hooks leave on vLLM's Request."""

from __future__ import annotations

import operator
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import HANDOFF_HEADER, PREFIX_BLOCK, Attr, SpanName

from .prefix import PrefixHashes
from .runtime import RT, ext_id_of, sampled, span

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
        attrs[Attr.PREFIX_BLOCK_TOKENS] = ph.block
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


#: what schedule() decided, until update_from_output() closes the step (a tuple: this is per step)
#: (step, t0, t1, admitted or None, running, waiting, resumed_reqs, finished, before): admitted, for a step
#: that may carry prompt tokens, is its new requests' ``(request id, Request, PrefillStats, tokens
#: computed before)`` (the id and the count read from vLLM's ``NewRequestData``, which is not kept);
#: None for a decode-only step; resumed_reqs: the requests it resumed after a preemption ``(request
#: id, its tokens, prompt and generated, if it was preempted in its decode, else 0)``, read on the
#: loop only in such a step; finished: for a step that may carry prompt tokens, vLLM's set of the
#: requests that finished or were aborted since the step before (``finished_req_ids``: a prefill in
#: progress ends there when its client went away), else None; before: vLLM's requests with a prompt
#: (or a recompute) in progress before the step (``EngineState.after_prompt``; () once handed over)
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
#: step's t_u0, t_u0, t_u1, previous step's end; as handed to the export sidecar, the snapshots of
#: the requests in prompt work only and, in place of ``num_scheduled_tokens``, ``(theirs, the batch
#: size)``: ``steps_handoff.prompt_work_only``); sorted out by ``_work_step``. Not the output
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
    #: vLLM's requests with a prompt (or a recompute) in progress after the last watched step (its own
    #: set, as a tuple): the next step is kept, and hands over their snapshots (``prompt_work_only``)
    after_prompt: tuple = ()
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
    #: where the steps are sorted out from handed-over copies (the export sidecar: :class:`.steps_handoff.StepSorter`),
    #: the requests whose queue span was made (a copy's first-schedule mark is not cleared in vLLM's
    #: process): request id -> None, the oldest let go past ``SEEN_MAX``; None in vLLM's process
    seen: dict | None = None
    shipped: bool = False  # the last hand-over carried steps (an empty one follows, once: the engine went idle)


#: the attribute the engine-input adapter leaves on vLLM's Request: when the input thread had it
RECEIVED = "_ttftscope_received"


#: the attribute the scheduler adapter leaves on vLLM's Request: when the scheduler had it (queued)
QUEUED = "_ttftscope_queued"


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
        # cached: vLLM's own count when it has one, else what was computed before
        chunks.append((req_id, n, ps.num_cached_tokens if ps is not None and ps.num_prompt_tokens else max(prior, 0),
                       0, th, external, _prefix_of(req, prompt, sched), sched.block_size, False))
    return (chunks, queued, recompute) if chunks or queued or recompute else None


def _prefix_of(req, prompt: int, sched) -> PrefixHashes | None:
    """The prompt's prefix hashes: vLLM's own block hashes where it made them (prefix caching on),
    else its token ids, hashed when encoded (:class:`.prefix.PrefixHashes`)."""
    engine = getattr(req, "block_hashes", None)
    if engine:
        return PrefixHashes.of_engine(engine, prompt, getattr(sched, "hash_block_size", None) or sched.block_size)
    toks = req.prompt_token_ids
    return PrefixHashes(toks) if toks is not None and len(toks) >= PREFIX_BLOCK else None


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


def _unobserved_attrs(engine: str) -> dict:
    return {Attr.ENGINE: engine}


def _work_step(st: EngineState, w: WorkStep):
    """A step that may have carried prompt tokens, sorted out off the loop: with prefill work
    or requests first scheduled, its spans (built on the export thread) and None (the open
    run ends before it); without, the ``DecodeStep`` it was, None (requests waited and
    nothing was scheduled: the run ends) or ``()`` (nothing to log)."""
    (step, t0, t1, admitted, running, waiting, resumed_reqs, finished, _), ns, total, cached_ids, cached_computed, \
        sched, prev_u0, t_u0, t_u1, prev_end = w
    if ns.__class__ is tuple:  # handed over (``steps_handoff.prompt_work_only``): (those read here, the batch)
        ns, batch = ns
    else:
        batch = len(ns)
    work = _prefill_work(st, sched, ns, cached_ids, cached_computed, admitted, step, resumed_reqs, finished)
    if work is None:
        if total:
            return (step, t0, t1, prev_u0, t_u0, t_u1, prev_end, total, running, waiting,
                    sched.max_num_running_reqs if waiting else 0)
        return None if waiting else ()
    d = RT.deferred  # several spans in one record: DeferredSpans.group
    if d is not None:
        d.group(_step_spans, (step, t0, t1, prev_u0, t_u0, t_u1, work, batch, running, waiting,
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
