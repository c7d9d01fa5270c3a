"""Engine-core adapters: ``queue`` (queued -> first scheduled), one ``prefill`` span per
chunk, one ``step`` span per engine step (runs of decode-only steps merged), and the engine's
cold start (ready once the KV cache is allocated).

On the engine loop the hooks keep plain numbers and references only (this module); the logged
steps are sorted out and decode steps folded into runs off the loop (:mod:`.steps`): in the
export sidecar, to which the plugin's step-flush thread hands the log every second
(``FOLD_EVERY_S``; :mod:`.steps_handoff`), or by that thread itself where there is no sidecar.
Quiet steps are sampled, the scheduler resting between samples (:mod:`.rest`)."""

from __future__ import annotations

import functools
import threading
import time

from ttftscope.schemas.vocabulary import ProcessRole

from .adapters import ENGINE, Internal, adapter
from .coldstart import emit_process_ready
from .config import FOLD_EVERY_S
from .rest import _rest, _unobserved, sample_quiet, wake
from .runtime import RT, at_exit, guard, hot, log, set_model, timing_floor, turn_off
from .steps import QUEUED, RECEIVED, EngineState
from .steps_handoff import _hand_over_as_plain, export_on_this_thread, steps_off_the_loop

_SCHED = "vllm.v1.core.sched.scheduler"
_REQ = "vllm.v1.request"


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
                    Internal(_REQ, "Request.request_id", "attribute"),
                    Internal(_REQ, "Request.trace_headers", "attribute"),
                    Internal(_REQ, "Request.num_prompt_tokens", "attribute"),
                    Internal(_REQ, "Request.prompt_token_ids", "attribute"),
                    Internal(_REQ, "Request.block_hashes", "attribute"),
                    Internal(_SCHED, "Scheduler.hash_block_size", "attribute"),
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
    tokens is sorted out off the loop, from the output's own snapshots (:func:`.steps._prefill_work`,
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
    before = st.after_prompt  # vLLM's prefills in progress before this step (as the last one left them)
    admitted = None
    # (a request preempted mid-prefill and resumed comes back among the cached requests, not
    # the new ones, and is no prefill in progress before its step: without the last test its
    # first resumed chunk was counted as decode tokens, seen on real vLLM with a small KV cache)
    resumed = out.scheduled_cached_reqs.resumed_req_ids
    resumed_reqs = ()
    finished = None
    if new or before or resumed:
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
    # prompts (or recomputes) still in progress after this step: vLLM's own set, as it is now
    inflight = sched._inflight_prefills
    st.after_prompt = tuple(inflight) if inflight else ()
    pending = st.pending
    pending[id(out)] = (step, t0, t1, admitted, len(sched.running), len(sched.waiting), resumed_reqs, finished, before)
    if len(pending) > 64:  # outputs that never came back (an aborted step): bounded
        del pending[next(iter(pending))]


@hot("step")
def _on_step_done(st: EngineState, sched, out, t_u0: float, t_u1: float) -> None:
    """A step closes: its prefill chunks end when its output reaches the scheduler (``t_u0``);
    its anatomy is schedule [t0, t1], execute (from :func:`.steps._overlap`, off the loop: the previous
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
