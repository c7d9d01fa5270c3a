"""Quiet steps (decode only, nobody waiting, no prefill in progress: they cannot delay a first
token) sampled: after ``TTFTSCOPE_QUIET_STEPS`` of them the scheduler *rests* (vLLM's own methods
bound on the instance shadow the wrappers: no Python of ours per step) until a request arrives or
the next second's sample; the stretch not watched is one ``unobserved`` span."""

from __future__ import annotations

import time

from .runtime import RT, log
from .steps import EngineState


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
    engine loop), made a span off the loop (:func:`.steps.fold_steps`)."""
    start, st.gap_from = st.gap_from, 0.0
    if end > start:
        st.log.append((start, end))
