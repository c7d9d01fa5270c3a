"""The engine core's logged steps handed to the export sidecar as they are, and sorted out there.

Sorting the logged steps out and folding decode steps into runs cost the engine core's step-flush
thread more CPU than any hook (bench/overhead: ~33 us a request, against ~39 for all the engine
core's hooks together), in vLLM's process and under its GIL. Where the export goes through a
sidecar (collector.handoff) the thread only hands the log over as it is, once a second: vLLM's
objects in it (its Request, PrefillStats, scheduler) are written as the plain values the sorting
reads (``plain_as``: on the export thread, as the frame is written) and the sidecar runs the same
sorting (:class:`StepSorter`, :mod:`.steps`) as the frames arrive."""

from __future__ import annotations

import time

from ttftscope.schemas.vocabulary import PREFIX_BLOCK, PREFIX_MAX_BLOCKS

from .config import FOLD_EVERY_S
from .runtime import RT
from .steps import QUEUED, RECEIVED, RUN_IDLE_S, EngineState, flush_decode_run


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
    items = [prompt_work_only(x) if x is not None and len(x) == 10 else x for x in items]  # (10: a WorkStep)
    if not items and not st.shipped and not final:
        return
    st.shipped = bool(items)
    d = RT.deferred
    if d is not None:
        d.steps(st.engine, items, time.time(), final)


#: a prompt step with fewer requests running beside its new ones is handed over whole: their few
#: snapshots pickle for about what sorting them out costs (bench/step_handover, warm: even from 0 to 32)
WHOLE_BELOW = 16


def prompt_work_only(w: tuple) -> tuple:
    """A logged step that may carry prompt tokens (``WorkStep``), as handed over: of its output's
    per-request snapshots (tokens scheduled, tokens computed before) only those the sorting reads,
    of the requests in prompt work (admitted in the step, resumed in it, or in vLLM's own set of
    prompts and recomputes in progress before it: the same rule as the sorting's, computed < tokens),
    with the step's batch size. The rest are the running decodes': O(running) of them a prompt step,
    pickled for nothing (bench/step_handover: 27.7 -> 7.9 us a request with 256 running, warm)."""
    p, ns, ids = w[0], w[1], w[3]
    before = p[8]
    if len(ids) < WHOLE_BELOW:  # few running beside the new requests: as it is (vLLM's Requests in prefill let go)
        return w if not before else (p[:8] + ((),), *w[1:])
    kept = {}
    for a in p[3]:  # admitted (never among the cached requests)
        n = ns.get(a[0])
        if n is not None:
            kept[a[0]] = n
    at = []  # (index among the cached requests, request id): kept in vLLM's order
    others = [r.request_id for r in before]
    if p[6]:  # resumed
        others += [i for i, _ in p[6]]
    for i in others:
        n = ns.get(i)
        if n is None or i in kept:
            continue
        kept[i] = n
        try:
            at.append((ids.index(i), i))  # (a C scan)
        except ValueError:
            continue
    at.sort()
    computed = w[4]
    return (p[:8] + ((),), (kept, len(ns)), w[2], [i for _, i in at], [computed[j] for j, _ in at],
            w[5], w[6], w[7], w[8], w[9])


class PlainRequest:
    """What the sorting reads of vLLM's ``Request``, handed over (``_plain_request``)."""

    __slots__ = ("trace_headers", "external_req_id", QUEUED, RECEIVED, "priority", "num_prompt_tokens",
                 "prompt_token_ids", "block_hashes")

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
    request is gone is not known here, :func:`.steps._let_go`)."""

    __slots__ = ("block_size", "max_num_running_reqs", "requests", "hash_block_size")

    def __init__(self, block_size, max_num_running_reqs, hash_block_size=None) -> None:
        self.block_size, self.max_num_running_reqs, self.requests = block_size, max_num_running_reqs, None
        self.hash_block_size = hash_block_size


def _plain_request(r) -> tuple:
    engine = getattr(r, "block_hashes", None)  # vLLM's own (prefix caching on): a few short bytes, not the prompt
    toks = None
    if engine:
        engine = engine[:PREFIX_MAX_BLOCKS]
    else:
        engine, toks = None, r.prompt_token_ids
        if toks is not None:  # the whole blocks that are hashed, as a plain list (pickled in C)
            k = min(len(toks), PREFIX_BLOCK * PREFIX_MAX_BLOCKS) // PREFIX_BLOCK * PREFIX_BLOCK
            toks = toks[:k] if k < len(toks) else toks
            if type(toks) is not list:  # (vLLM's own list type, or a view)
                toks = list(toks)
    return PlainRequest, (r.trace_headers, getattr(r, "external_req_id", None), getattr(r, QUEUED, None),
                          getattr(r, RECEIVED, None), r.priority, r.num_prompt_tokens, toks, engine)


def _plain_stats(ps) -> tuple:
    return PlainStats, (ps.num_cached_tokens, ps.num_prompt_tokens)


def _plain_scheduler(sched) -> tuple:
    return PlainScheduler, (sched.block_size, sched.max_num_running_reqs, getattr(sched, "hash_block_size", None))


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
    (:func:`.steps.flush_decode_run`), on each engine's own state: its prefills in progress, its open
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
