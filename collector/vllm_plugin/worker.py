"""Worker adapters: per-step ``allreduce`` spans (rank, count, bytes, time), sampled
``allreduce.call`` spans from torch.profiler windows, and the worker's cold start.

No Python of ours runs inside compiled or graph-captured code. vLLM compiles the model with
torch.compile by default (CPU and GPU) and captures CUDA graphs on the GPU: a Python wrapper
around the communicator's ``all_reduce`` would be traced by dynamo ("Attempted to call
function marked as skipped": vLLM's compiled TP start-up dies). So the per-call collective
timing is installed only when the worker's own configuration says the model runs eagerly
(``CompilationConfig.mode == NONE`` and no CUDA graphs), decided when the model is loaded,
before anything is compiled. Otherwise collectives are seen through the sampled
torch.profiler windows (``TTFTSCOPE_PROFILE_EVERY``), which wrap a whole step from outside.
A worker with nothing to time per step (compiled or TP = 1, and no windows: vLLM's defaults)
hands vLLM's own ``execute_model`` back after its first step (:func:`steps_needed`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass, field

from ttftscope.schemas.phases import Phase
from ttftscope.schemas.vocabulary import Attr, ProcessRole, SpanName

from .adapters import WORKER, Internal, adapter
from .coldstart import emit_process_ready
from .runtime import RT, guard, log, set_model, span, timing_floor

_GPU_WORKER = "vllm.v1.worker.gpu_worker"
_CPU_COMM = "vllm.distributed.device_communicators.cpu_communicator"
_CUDA_COMM = "vllm.distributed.device_communicators.cuda_communicator"


@dataclass
class WorkerState:
    count: int = 0
    bytes: int = 0
    time: float = 0.0
    first: float | None = None
    step: int | None = None
    rank: int | None = None
    tp: int = 1
    engine: str = field(default_factory=lambda: f"engine-{os.getppid()}")  # the engine core that spawned us
    eager: bool | None = None  # decided at load_model, from the worker's compilation config
    cuda_pending: list = field(default_factory=list)
    calls: int = 0  # execute_model calls, for the sampled profiler windows
    profile_every: int = 0
    release_steps: object = None  # puts vLLM's own execute_model back (set by the worker-steps adapter)


def workers_number_steps(profile_every: int, eager: bool, tp: int) -> bool:
    """Whether the workers time something per step and name it by the engine's step number:
    collectives timed per call (an eager model with TP > 1) or sampled profiler windows. The
    worker's step wrapper and the engine's quiet-step sampling both ask this."""
    return bool(profile_every) or (bool(eager) and tp > 1)


def steps_needed(ws: WorkerState) -> bool:
    """Whether the step wrapper has anything to do in this worker (:func:`workers_number_steps`).
    Otherwise (vLLM's default compiled mode, or TP = 1 without windows) it would cost every step a
    few microseconds for nothing."""
    return workers_number_steps(ws.profile_every, ws.eager, ws.tp)


WS = WorkerState()


def model_runs_eagerly(vllm_config) -> bool:
    """True when vLLM runs the model without torch.compile and without CUDA graphs."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = vllm_config.compilation_config
    if cc.mode != CompilationMode.NONE:
        return False
    return cc.cudagraph_mode in (None, CUDAGraphMode.NONE)


@adapter("collectives-eager", roles=WORKER,
         what="per-call collective timing (CPU: shm/gloo; CUDA: events read without syncing), only when the "
              "model runs eagerly (no torch.compile, no CUDA graphs); decided when the model is loaded",
         internals=[Internal(_GPU_WORKER, "Worker.load_model"),
                    Internal("vllm.v1.worker.worker_base", "WorkerBase.vllm_config", "attribute"),
                    Internal("vllm.config.model", "ModelConfig.served_model_name", "attribute"),
                    Internal("vllm.config.compilation", "CompilationConfig.mode", "attribute"),
                    Internal("vllm.config.compilation", "CompilationConfig.cudagraph_mode", "attribute"),
                    Internal("vllm.config.compilation", "CompilationMode.NONE", "attribute"),
                    Internal("vllm.config.compilation", "CUDAGraphMode.NONE", "attribute"),
                    Internal(_CPU_COMM, "CpuCommunicator.all_reduce")])
def _install_collectives_eager() -> None:
    from vllm.v1.worker import gpu_worker

    orig_load = gpu_worker.Worker.load_model

    @functools.wraps(orig_load)
    def load_model(self, *a, **kw):
        _decide_eager(self)
        return orig_load(self, *a, **kw)

    gpu_worker.Worker.load_model = load_model


@guard("decide_eager")
def _decide_eager(worker) -> None:
    if WS.eager is not None:
        return
    set_model(worker.vllm_config.model_config.served_model_name)
    WS.eager = model_runs_eagerly(worker.vllm_config)
    if not WS.eager:
        log.info("ttftscope: the model is compiled; collectives are seen through sampled profiler windows "
                 "(TTFTSCOPE_PROFILE_EVERY), never by a wrapper inside the compiled graph")
        return
    from vllm.distributed.device_communicators import cpu_communicator as cc

    orig_ar = cc.CpuCommunicator.all_reduce

    @functools.wraps(orig_ar)
    def all_reduce(self, input_):
        t = time.perf_counter()
        w = time.time()
        out = orig_ar(self, input_)
        _on_allreduce(WS, input_, w, time.perf_counter() - t)
        return out

    cc.CpuCommunicator.all_reduce = all_reduce
    _install_cuda_allreduce_eager()


def _install_cuda_allreduce_eager() -> None:
    """Per-call collective timing on CUDA (eager only: no graphs to break)."""
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
        if torch.cuda.is_current_stream_capturing():
            return orig(self, input_, *a, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = orig(self, input_, *a, **kw)
        end.record()
        WS.cuda_pending.append((start, end, time.time(), int(input_.numel() * input_.element_size())))
        return out

    cu.CudaCommunicator.all_reduce = all_reduce


@adapter("worker-steps", roles=WORKER,
         what="per-step allreduce spans and the sampled torch.profiler windows (TTFTSCOPE_PROFILE_EVERY)",
         internals=[Internal(_GPU_WORKER, "Worker.execute_model"),
                    Internal("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank"),
                    Internal("vllm.distributed.parallel_state", "get_tensor_model_parallel_world_size")])
def _install_worker_steps() -> None:
    from vllm.v1.worker import gpu_worker

    WS.profile_every = RT.config.profile_every
    orig = gpu_worker.Worker.execute_model  # CPUWorker inherits it

    floor = timing_floor if RT.config.self_timing_dir else None

    def release() -> None:
        if gpu_worker.Worker.execute_model is execute_model:
            gpu_worker.Worker.execute_model = orig
            log.info("ttftscope: nothing to time per step in this worker (compiled or TP=1, no profiler "
                     "windows): vLLM's execute_model runs unwrapped")

    WS.release_steps = release

    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *a, **kw):
        _on_exec_start(WS, scheduler_output)
        if floor is not None:
            floor(WS, scheduler_output)
        try:
            if _profile_now(WS):
                return _profiled(WS, orig, self, scheduler_output, *a, **kw)
            return orig(self, scheduler_output, *a, **kw)
        finally:
            _on_exec_end(WS)

    gpu_worker.Worker.execute_model = execute_model


@adapter("worker-ready", roles=WORKER, what="the worker's cold start (process start -> warm-up/compile done)",
         internals=[Internal(_GPU_WORKER, "Worker.compile_or_warm_up_model"),
                    Internal("vllm.v1.worker.cpu_worker", "CPUWorker.compile_or_warm_up_model")])
def _install_worker_ready() -> None:
    from vllm.v1.worker import cpu_worker, gpu_worker

    for cls in (gpu_worker.Worker, cpu_worker.CPUWorker):
        if "compile_or_warm_up_model" not in vars(cls):
            continue
        orig_ready = vars(cls)["compile_or_warm_up_model"]

        def make(orig_ready):
            @functools.wraps(orig_ready)
            def wrapped(self, *a, **kw):
                r = orig_ready(self, *a, **kw)
                warm_profiler(WS)
                emit_process_ready(ProcessRole.WORKER.value, WS.rank)
                return r
            return wrapped

        cls.compile_or_warm_up_model = make(orig_ready)


@guard("warm_profiler")
def warm_profiler(ws: WorkerState) -> None:
    """With sampled windows on, start and stop one empty profile while the worker warms up:
    the first profile on a GPU initialises CUPTI, which stalls that step for seconds — a cost
    for start-up, not for a request's step."""
    if not ws.profile_every:
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts):
        if torch.cuda.is_available():
            torch.cuda.synchronize()


@guard("profile_now")
def _profile_now(ws: WorkerState) -> bool:
    """Every TTFTSCOPE_PROFILE_EVERY-th step runs under torch.profiler (off by default)."""
    if not ws.profile_every:
        return False
    ws.calls += 1
    return ws.calls % ws.profile_every == 0


def _profiled(ws: WorkerState, orig, *args, **kw):
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
                             args=(prof, wall0, ws.step, ws.rank, ws.tp, ws.engine, bool(ws.eager)),
                             daemon=True).start()
        except Exception:  # noqa: BLE001
            ws.profile_every = 0
            log.exception("ttftscope: profiler window failed; sampled collective windows are off")


#: what a collective's op or kernel name contains: torch's and vLLM's ops (``c10d::allreduce_``,
#: ``vllm::all_reduce``), NCCL's kernels (``ncclDevKernel_AllReduce_...``), symmetric-memory and
#: FlashInfer kernels (``multimem_all_reduce``, ``allreduce_fusion``), and vLLM's custom
#: all-reduce on NVLink GPUs, the default for TP there, whose kernels say neither
#: (``vllm::cross_device_reduce_1stage`` / ``_2stage``)
COLLECTIVE_NAMES = ("allreduce", "all_reduce", "cross_device_reduce")


def _is_collective(name: str) -> bool:
    n = name.lower()
    return any(c in n for c in COLLECTIVE_NAMES)


#: the name prefix of a process-group backend's own record of a collective's work (gloo runs it
#: on its thread, after the ``c10d::allreduce_`` op that queued it has returned)
BACKEND_WORK = ("gloo:",)


def _with_backend_work(calls: list) -> list[tuple[object, tuple[float, float]]]:
    """Each collective call with its (start, end) in profiler µs. Where vLLM falls back from its
    shared-memory all-reduce to torch.distributed's gloo (as when its ranks disagree on the SHM
    group's name), the profiler records the ``c10d`` op and, on gloo's thread, the work it
    queued: one call, not two. The work belongs to the op before it, and the call ends when the
    work does (the caller waits for it)."""
    ops = sorted((e for e in calls if not e.name.startswith(BACKEND_WORK)), key=lambda e: e.time_range.start)
    work = sorted((e for e in calls if e.name.startswith(BACKEND_WORK)), key=lambda e: e.time_range.start)
    if not ops:  # only the backend's records: each is a call
        return [(w, (w.time_range.start, w.time_range.end)) for w in work]
    out = [[op, op.time_range.start, op.time_range.end] for op in ops]
    i = 0
    for w in work:
        while i + 1 < len(out) and out[i + 1][1] <= w.time_range.start:
            i += 1
        out[i][2] = max(out[i][2], w.time_range.end)
    return [(op, (t0, t1)) for op, t0, t1 in out]


@guard("profiled_collectives")
def _emit_profiled_collectives(prof, wall0: float, step, rank, tp, engine: str, hooked: bool) -> None:
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
    spans = _with_backend_work(calls)
    step = step if step is not None else -1
    total, first = 0.0, None
    for e, (t0, t1) in spans:
        start = wall0 + (t0 - t_first) / 1e6
        dur = (t1 - t0) / 1e6
        total += dur
        first = start if first is None else min(first, start)
        span(SpanName.ALLREDUCE_CALL, start, start + dur, {
            Attr.STEP: step, Attr.RANK: rank, Attr.TP_SIZE: tp, Attr.SAMPLED: True,
            Attr.PHASE: Phase.ALLREDUCE.value, Attr.COLLECTIVE: e.name, Attr.ENGINE: engine})
    if calls and not hooked:  # compiled model: no per-call hook, the window is the step's only measure
        span(SpanName.ALLREDUCE, first, first + total, {
            Attr.STEP: step, Attr.RANK: rank, Attr.TP_SIZE: tp, Attr.ALLREDUCE_COUNT: len(calls),
            Attr.SAMPLED: True, Attr.PHASE: Phase.ALLREDUCE.value, Attr.ENGINE: engine})


@guard("allreduce")
def _on_allreduce(ws: WorkerState, input_, wall: float, dt: float) -> None:
    ws.count += 1
    ws.bytes += int(input_.numel() * input_.element_size())
    ws.time += dt
    if ws.first is None:
        ws.first = wall


@guard("exec_start")
def _on_exec_start(ws: WorkerState, scheduler_output) -> None:
    ws.count, ws.bytes, ws.time, ws.first = 0, 0, 0.0, None
    ws.step = getattr(scheduler_output, "_ttftscope_step", None)  # ours, set by the engine adapter
    if ws.rank is None:
        from vllm.distributed import parallel_state as ps

        try:
            ws.rank = ps.get_tensor_model_parallel_rank()
            ws.tp = ps.get_tensor_model_parallel_world_size()
        except AssertionError:  # no TP group (e.g. an offline engine without one)
            ws.rank, ws.tp = 0, 1
        if not steps_needed(ws) and ws.release_steps is not None:
            ws.release_steps()  # from the next step on; this one ends as usual


@guard("exec_end")
def _on_exec_end(ws: WorkerState) -> None:
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
    span(SpanName.ALLREDUCE, ws.first, ws.first + ws.time, {
        Attr.STEP: ws.step if ws.step is not None else -1, Attr.RANK: ws.rank, Attr.TP_SIZE: ws.tp,
        Attr.ALLREDUCE_COUNT: ws.count, Attr.ALLREDUCE_BYTES: ws.bytes, Attr.PHASE: Phase.ALLREDUCE.value,
        Attr.ENGINE: ws.engine})
