"""A test-only vLLM plugin that plants a cause of known size (never installed with ttftscope).

tests/conftest.py puts this directory (with a dist-info that registers the entry point
``vllm.general_plugins: planted``) on the vLLM server's PYTHONPATH. What it plants is chosen
by environment variables, read in the process where the cause belongs:

* ``PLANTED_DELIVER_STALL_MS``: the API server's event loop is blocked this long after every
  output batch it processes (as a slow detokenizer or a heavy middleware would), i.e. after
  vLLM's own TTFT clock stopped and before the bytes go out.
* ``PLANTED_EXECUTE_MS``: every worker step takes this much longer (model time).
* ``PLANTED_UPDATE_MS``: the engine core spends this much longer in ``update_from_output``
  (engine host overhead per step).
* ``PLANTED_TOKENIZE_US_PER_TOKEN``: the API server's tokenizer takes this much longer per
  prompt token (in vLLM's tokenizer thread pool, where a slow tokenizer would spend it).
* ``PLANTED_ALLREDUCE_MS`` (with ``PLANTED_ALLREDUCE_FLAG``, a path): every tensor-parallel
  all-reduce on the CPU communicator takes this much longer on every rank while the flag file
  exists (a slow interconnect), inside the collective (under the communicator's
  ``all_reduce``, where ttftscope times it in eager mode). The flag lets one server run
  clean, then slowed.
* ``PLANTED_ALLREDUCE_US_PER_ROW`` (with ``PLANTED_ALLREDUCE_ROW_FLAG``, a path): while that flag
  exists every all-reduce takes this much longer per row of its input (a step's tokens: a
  collective whose time grows with the batch, as a bandwidth-bound interconnect's does); each
  worker step's count of all-reduces and their rows is appended to ``<flag>.steps``.
* ``PLANTED_SWITCH_DIR`` (a directory): the delivery stall, the execute and update slowness,
  the loop pause and the slow tokenizer are then planted only while a file named after their variable exists there
  (``PLANTED_DELIVER_STALL_MS`` ...), so that one server runs clean, then with one fault, then
  another: one start-up for several scenarios, each with the same server as its baseline.
* ``PLANTED_LOOP_PAUSE_MS``: the engine core's busy loop pauses this long after every step
  that ran the model, once its outputs are on their way (``EngineCore.post_step``): idle
  engine-loop time between steps while requests wait (a bubble: as a garbage-collection pause
  or a slow callback in the loop would make).
* ``PLANTED_TOKEN_BUDGET``: the scheduler's token budget per step (as ``--max-num-batched-tokens``)
  this small, with a switch file only while it exists (``PLANTED_TOKEN_BUDGET`` in the switch
  directory): long prompts prefilled in many chunks, against the same server's own budget.
* ``PLANTED_FIRST_STEPS_MS`` with ``PLANTED_FIRST_STEPS`` (a count): the first that many
  worker steps that carry requests take this much longer (one-off initialisation that the
  first requests after a start pay: lazy kernels, allocator growth, caches warming).
* ``PLANTED_HOST_GAP_MS``: the API server's serving layer awaits this long (its event loop free
  for other requests) after rendering a prompt and before handing the request to the engine, in
  ``BaseServing._get_trace_headers``, which runs between the two (as an async check a
  middleware or an adapter lookup would make between them); with a switch file in
  ``PLANTED_SWITCH_DIR``.
* ``PLANTED_STARTUP_IDLE_S`` (with ``PLANTED_STARTUP_IDLE_LOG``, a path): the CPU worker waits
  this long once its weights are loaded, before it profiles memory and warms up (compiles) the
  model, outside every loading span (as a lock on a shared cache or a slow mount nobody
  instrumented would make it wait); it writes the wait's start and end (epoch seconds) to the log.

Not a fault, a witness: ``PLANTED_EVENTS_LOG`` (a path): the engine core appends every request
event vLLM records (``Request.record_event``: QUEUED, SCHEDULED, PREEMPTED, with vLLM's own
monotonic timestamp) as a line ``request_id TYPE timestamp``, so a test can hold the product's
spans against vLLM's own account of when a request was preempted and when it ran again.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time


def _switch(var: str):
    """A check for whether the fault planted by ``var`` is on now (always, without a switch dir)."""
    where = os.environ.get("PLANTED_SWITCH_DIR")
    if not where:
        return lambda: True
    path = os.path.join(where, var)
    return lambda: os.path.exists(path)


def _slow(cls, name: str, ms: float, on, before: bool = False) -> None:
    """``cls.name`` ``ms`` longer while ``on()``: after the call, or ``before`` it (where the
    call's own result is stamped inside it: vLLM's engine core stamps its outputs at the end of
    ``update_from_output``, so its own Python work comes before that stamp)."""
    orig = getattr(cls, name)
    if ms <= 0 or getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def slowed(self, *a, **kw):
        if before and on():
            time.sleep(ms / 1000)
        out = orig(self, *a, **kw)
        if not before and on():
            time.sleep(ms / 1000)
        return out

    slowed._planted = True
    setattr(cls, name, slowed)


def _slow_tokenizer(us_per_token: float, on) -> None:
    from vllm.renderers.base import BaseRenderer

    orig = BaseRenderer._tokenize_prompt
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def tokenize(self, *a, **kw):
        out = orig(self, *a, **kw)
        if on():
            time.sleep(us_per_token * len(out["prompt_token_ids"]) / 1e6)
        return out

    tokenize._planted = True
    BaseRenderer._tokenize_prompt = tokenize  # bound per renderer at its __init__: patch before


def _slow_allreduce(ms: float, flag: str | None, us_per_row: float = 0.0, row_flag: str | None = None) -> None:
    from vllm.distributed.device_communicators import cpu_communicator as cc

    orig_init = cc.CpuCommunicator.__init__
    if getattr(orig_init, "_planted", False):
        return
    step = [0, 0]  # all-reduces and their rows in the worker step under way (row plant on)

    class Slowed:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def all_reduce(self, *a, **kw):
            if flag and os.path.exists(flag):
                time.sleep(ms / 1000)
            if row_flag and os.path.exists(row_flag) and a and getattr(a[0], "dim", lambda: 0)():
                rows = int(a[0].shape[0])  # a step's tokens: its running requests when it only decodes
                time.sleep(us_per_row * rows / 1e6)
                step[0] += 1
                step[1] += rows
            return self.inner.all_reduce(*a, **kw)

    if row_flag:  # what was planted, step by step, for the test to check the finding against:
        # "<all-reduces> <their rows>" per worker step, appended to <row_flag>.steps
        from vllm.v1.worker import gpu_worker

        orig_exec = gpu_worker.Worker.execute_model

        @functools.wraps(orig_exec)
        def execute_model(self, *a, **kw):
            step[0] = step[1] = 0
            try:
                return orig_exec(self, *a, **kw)
            finally:
                if step[0]:
                    with open(row_flag + ".steps", "a") as f:
                        f.write(f"{step[0]} {step[1]}\n")

        gpu_worker.Worker.execute_model = execute_model

    @functools.wraps(orig_init)
    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        self.dist_module = Slowed(self.dist_module)

    init._planted = True
    cc.CpuCommunicator.__init__ = init


def _slow_first_steps(ms: float, n: int) -> None:
    from vllm.v1.worker import gpu_worker

    orig = gpu_worker.Worker.execute_model
    if getattr(orig, "_planted", False):
        return
    left = [n]

    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *a, **kw):
        if left[0] > 0 and getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            left[0] -= 1
            time.sleep(ms / 1000)
        return orig(self, scheduler_output, *a, **kw)

    execute_model._planted = True
    gpu_worker.Worker.execute_model = execute_model


def _loop_pause(ms: float, on) -> None:
    from vllm.v1.engine import core

    orig = core.EngineCore.post_step
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def post_step(self, model_executed, *a, **kw):
        out = orig(self, model_executed, *a, **kw)
        if model_executed and on():
            time.sleep(ms / 1000)
        return out

    post_step._planted = True
    core.EngineCore.post_step = post_step


def _token_budget(tokens: int, on) -> None:
    """The scheduler's token budget per step (``--max-num-batched-tokens``) at ``tokens`` while
    ``on()``, the server's own otherwise: a small prefill budget switched on one server, so its
    baseline is the same server."""
    from vllm.v1.core.sched import scheduler

    orig = scheduler.Scheduler.schedule
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def schedule(self, *a, **kw):
        own = self.__dict__.setdefault("_planted_own_budget", self.max_num_scheduled_tokens)
        self.max_num_scheduled_tokens = min(tokens, own) if on() else own
        return orig(self, *a, **kw)

    schedule._planted = True
    scheduler.Scheduler.schedule = schedule


def _host_gap(ms: float, on) -> None:
    import asyncio

    from vllm.entrypoints.serve.engine import serving

    orig = serving.BaseServing._get_trace_headers
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    async def get_trace_headers(self, *a, **kw):
        if on():
            await asyncio.sleep(ms / 1000)
        return await orig(self, *a, **kw)

    get_trace_headers._planted = True
    serving.BaseServing._get_trace_headers = get_trace_headers


def _startup_idle(s: float, log: str | None) -> None:
    from vllm.v1.worker import cpu_worker

    orig = cpu_worker.CPUWorker.determine_available_memory
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def determine_available_memory(self, *a, **kw):
        t0 = time.time()
        time.sleep(s)
        if log:
            with open(log, "a") as f:
                f.write(f"{t0} {time.time()}\n")
        return orig(self, *a, **kw)

    determine_available_memory._planted = True
    cpu_worker.CPUWorker.determine_available_memory = determine_available_memory


def _log_events(path: str) -> None:
    from vllm.v1 import request as rq

    orig = rq.Request.record_event
    if getattr(orig, "_planted", False):
        return

    @functools.wraps(orig)
    def record_event(self, event_type, timestamp=None):
        with open(path, "a") as f:
            f.write(f"{self.request_id} {event_type.name} {time.monotonic() if timestamp is None else timestamp!r}\n")
        return orig(self, event_type, timestamp)

    record_event._planted = True
    rq.Request.record_event = record_event


def register() -> None:
    events = os.environ.get("PLANTED_EVENTS_LOG")
    if events:  # (only the engine core records them)
        _log_events(events)
    execute = float(os.environ.get("PLANTED_EXECUTE_MS", "0") or 0)
    update = float(os.environ.get("PLANTED_UPDATE_MS", "0") or 0)
    if execute > 0:
        from vllm.v1.worker import gpu_worker

        _slow(gpu_worker.Worker, "execute_model", execute, _switch("PLANTED_EXECUTE_MS"))  # only workers call it
    if update > 0:
        from vllm.v1.core.sched import scheduler

        _slow(scheduler.Scheduler, "update_from_output", update, _switch("PLANTED_UPDATE_MS"), before=True)  # only the engine core calls it
    budget = int(os.environ.get("PLANTED_TOKEN_BUDGET", "0") or 0)
    if budget > 0:
        _token_budget(budget, _switch("PLANTED_TOKEN_BUDGET"))  # only the engine core schedules
    pause = float(os.environ.get("PLANTED_LOOP_PAUSE_MS", "0") or 0)
    if pause > 0:
        _loop_pause(pause, _switch("PLANTED_LOOP_PAUSE_MS"))  # only the engine core steps
    first_ms = float(os.environ.get("PLANTED_FIRST_STEPS_MS", "0") or 0)
    if first_ms > 0:
        _slow_first_steps(first_ms, int(os.environ.get("PLANTED_FIRST_STEPS", "0") or 0))
    allreduce, flag = float(os.environ.get("PLANTED_ALLREDUCE_MS", "0") or 0), os.environ.get("PLANTED_ALLREDUCE_FLAG")
    per_row, row_flag = (float(os.environ.get("PLANTED_ALLREDUCE_US_PER_ROW", "0") or 0),
                         os.environ.get("PLANTED_ALLREDUCE_ROW_FLAG"))
    idle = float(os.environ.get("PLANTED_STARTUP_IDLE_S", "0") or 0)
    if idle > 0 and "Worker" in multiprocessing.current_process().name:  # a worker process only
        _startup_idle(idle, os.environ.get("PLANTED_STARTUP_IDLE_LOG"))
    if (allreduce > 0 and flag) or (per_row > 0 and row_flag):
        _slow_allreduce(allreduce, flag if allreduce > 0 else None, per_row, row_flag if per_row > 0 else None)
    if "api_server" not in " ".join(sys.argv):
        return
    per_token = float(os.environ.get("PLANTED_TOKENIZE_US_PER_TOKEN", "0") or 0)
    if per_token > 0:
        _slow_tokenizer(per_token, _switch("PLANTED_TOKENIZE_US_PER_TOKEN"))
    gap = float(os.environ.get("PLANTED_HOST_GAP_MS", "0") or 0)
    if gap > 0:
        _host_gap(gap, _switch("PLANTED_HOST_GAP_MS"))
    ms = float(os.environ.get("PLANTED_DELIVER_STALL_MS", "0") or 0)
    if ms <= 0:
        return
    from vllm.v1.engine import output_processor as op

    orig = op.OutputProcessor.process_outputs
    if getattr(orig, "_planted", False):
        return
    on = _switch("PLANTED_DELIVER_STALL_MS")

    @functools.wraps(orig)
    def process_outputs(self, *a, **kw):
        out = orig(self, *a, **kw)
        if on():
            time.sleep(ms / 1000)  # blocks the event loop: every stream waits
        return out

    process_outputs._planted = True
    op.OutputProcessor.process_outputs = process_outputs
