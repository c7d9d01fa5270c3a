"""The plugin's adapters against the installed vLLM (no server): every internal they touch
exists, a missing one disables only its adapter with a warning naming it, the eager/compiled
decision reads vLLM's own config, configuration honours the OTEL_* variables, and
`ttftscope doctor` reports all of it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import subprocess
from types import SimpleNamespace

import pytest
from conftest import PY, ROOT
from ttftscope.collector.vllm_plugin import adapters as ad
from ttftscope.collector.vllm_plugin.config import PluginConfig

#: a scheduler output's ``scheduled_cached_reqs`` with no request in it (vLLM's outputs always carry one)
NO_CACHED = SimpleNamespace(req_ids=[], num_computed_tokens=[], resumed_req_ids=set())


def test_every_adapter_finds_every_vllm_internal_it_touches():
    checked = ad.check_all()
    assert len(checked) >= 8
    bad = {a.name: a.problems for a in checked if a.problems}
    assert not bad, bad
    assert ad.version_known(ad.vllm_version()), ad.vllm_version()


@pytest.mark.parametrize("internal,missing", [
    (ad.Internal("vllm.v1.request", "Request.num_cached_tokens", "attribute"), True),  # gone in 0.32
    (ad.Internal("vllm.v1.request", "Request.prefill_stats", "attribute"), False),  # set in __init__
    (ad.Internal("vllm.v1.metrics.stats", "PrefillStats.num_cached_tokens", "attribute"), False),  # dataclass
    (ad.Internal("vllm.v1.engine", "EngineCoreOutput.trace_headers", "attribute"), False),  # msgspec field
    (ad.Internal("vllm.v1.core.sched.scheduler", "Scheduler.no_such_method"), True),
    (ad.Internal("vllm.no_such_module", "X"), True),
])
def test_internal_lookup_tells_present_from_missing(internal, missing):
    assert (internal.problem() is not None) == missing, internal.problem()


def test_a_missing_internal_disables_only_its_adapter_with_one_warning(caplog):
    calls = []
    name = "test-missing-internal"
    ad.ADAPTERS[name] = ad.Adapter(name, frozenset({"test-role"}),
                                   (ad.Internal("vllm.v1.request", "Request.num_cached_tokens", "attribute"),),
                                   lambda: calls.append("installed"), "a test adapter")
    ok = "test-present-internal"
    ad.ADAPTERS[ok] = ad.Adapter(ok, frozenset({"test-role"}), (ad.Internal("vllm.v1.request", "Request"),),
                                 lambda: calls.append("ok"), "a test adapter")
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.ttftscope"):
            got = {a.name: a.state for a in ad.install_for("test-role")}
        assert got == {name: "disabled", ok: "active"}
        assert calls == ["ok"], "the broken adapter was never installed"
        warns = [r.getMessage() for r in caplog.records if name in r.getMessage()]
        assert len(warns) == 1 and "Request.num_cached_tokens" in warns[0] and "0.32" in warns[0]
    finally:
        ad.ADAPTERS.pop(name, None)
        ad.ADAPTERS.pop(ok, None)


def test_eager_or_compiled_is_read_from_vllms_compilation_config():
    from ttftscope.collector.vllm_plugin.worker import model_runs_eagerly
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    def cfg(mode, graphs):
        return SimpleNamespace(compilation_config=CompilationConfig(mode=mode, cudagraph_mode=graphs))

    assert model_runs_eagerly(cfg(CompilationMode.NONE, CUDAGraphMode.NONE))
    assert not model_runs_eagerly(cfg(CompilationMode.VLLM_COMPILE, CUDAGraphMode.NONE))
    assert not model_runs_eagerly(cfg(CompilationMode.NONE, CUDAGraphMode.PIECEWISE))


@pytest.mark.parametrize("eager, tp, profile_every, wrapped", [
    (False, 2, 0, False),  # vLLM's default (compiled): nothing of ours can run per step
    (True, 1, 0, False),  # eager, but no collectives to time with TP = 1
    (None, 1, 0, False),  # the eager/compiled adapter did not run (disabled): nothing hooked
    (True, 2, 0, True),  # eager TP = 2: each step's all-reduces become a span
    (False, 2, 4, True),  # compiled, sampled profiler windows
    (False, 1, 8, True)])
def test_the_worker_step_wrapper_steps_aside_when_it_has_nothing_to_time(monkeypatch, eager, tp, profile_every,
                                                                         wrapped):
    """The worker's execute_model wrapper costs every step a few microseconds; it puts vLLM's
    method back after the first step unless per-call collective timing or profiler windows
    need it, and a step still returns vLLM's output either way."""
    from ttftscope.collector.vllm_plugin import worker as W
    from vllm.distributed import parallel_state as ps
    from vllm.v1.worker import gpu_worker

    calls = []

    def vllms(self, scheduler_output, *a, **kw):  # stands in for vLLM's method (no model here)
        calls.append(scheduler_output)
        return ("output", scheduler_output)

    monkeypatch.setattr(gpu_worker.Worker, "execute_model", vllms)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(W, "WS", W.WorkerState(eager=eager))
    monkeypatch.setattr(W.RT, "config", dataclasses.replace(W.RT.config, profile_every=profile_every))
    monkeypatch.setattr(W, "_profiled", lambda ws, orig, *a, **kw: orig(*a, **kw))  # no torch.profiler here
    W._install_worker_steps()
    ours = gpu_worker.Worker.execute_model
    assert ours is not vllms
    for step in range(3):
        out = gpu_worker.Worker.execute_model(object(), SimpleNamespace(_ttftscope_step=step))
        assert out[0] == "output" and out[1]._ttftscope_step == step
    assert len(calls) == 3
    assert (gpu_worker.Worker.execute_model is ours) == wrapped
    assert (gpu_worker.Worker.execute_model is vllms) == (not wrapped)


def test_a_failing_step_hook_turns_the_step_hooks_off_and_never_reaches_vllm(monkeypatch, caplog):
    """The engine loop's step hooks run without a guard of their own (a call layer costs
    microseconds per step there): the scheduler wrappers catch what they raise, log it once, turn
    both step hooks off, and vLLM's schedule and update return their own results all the same."""
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from vllm.v1.core.sched import scheduler as sched_mod

    S = sched_mod.Scheduler
    outputs = []

    def schedule(self, *a, **kw):  # stands in for vLLM's methods (no engine here)
        out = SimpleNamespace(finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[], num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1)
        outputs.append(out)
        return out

    def update(self, scheduler_output, *a, **kw):
        return ("updated", scheduler_output)

    for name, fn in (("add_request", lambda self, r: None), ("schedule", schedule), ("update_from_output", update)):
        monkeypatch.setattr(S, name, fn)
    monkeypatch.setattr(E, "ST", SP.EngineState())
    E._install_scheduler()
    me = SimpleNamespace(running=[1], waiting=[], max_num_running_reqs=8, _inflight_prefills=set())
    out = S.schedule(me)
    assert out is outputs[0] and out._ttftscope_step == 1, "a healthy step: stamped for the workers"
    assert S.update_from_output(me, out) == ("updated", out)
    assert len(E.ST.log) == 1, "and logged"
    broken = SimpleNamespace(running=None, waiting=[], max_num_running_reqs=8, _inflight_prefills=set())  # len(None) raises in the hook
    with caplog.at_level(logging.ERROR, logger="vllm.ttftscope"):
        for _ in range(3):
            out = S.schedule(broken)
            assert out is outputs[-1], "vLLM's output all the same"
            assert S.update_from_output(broken, out) == ("updated", out)
    failures = [r for r in caplog.records if "failed and is now disabled" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    out = S.schedule(me)
    assert not hasattr(out, "_ttftscope_step") and len(E.ST.log) == 1, "the step hooks stay off"


@pytest.mark.parametrize("hook", ["tokenize", "output", "http"])
def test_a_failing_api_server_hook_turns_itself_off_and_never_reaches_vllm(monkeypatch, caplog, hook):
    """The API server's once-a-request hooks run without a guard layer of their own (a call layer
    is ~1.3 us of CPU with the event loop's caches cold): the adapter's wrapper around vLLM's method
    (or the middleware) catches what the hook raises, logs it once, turns that hook off, and vLLM's
    own result reaches vLLM all the same, every time (the llm_request hook: test_vllm_request_span)."""
    import asyncio
    from types import SimpleNamespace as NS

    from ttftscope.collector.vllm_plugin import frontend as F
    from ttftscope.collector.vllm_plugin import http as H
    from vllm.entrypoints.serve.engine import serving
    from vllm.v1.engine import output_processor as op

    raised = []

    def boom(*a, **kw):
        raised.append(a)
        raise RuntimeError("boom")

    tp = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    if hook == "tokenize":
        async def vllms(self, headers):
            return {"traceparent": tp}
        monkeypatch.setattr(serving.BaseServing, "_get_trace_headers", vllms)
        monkeypatch.setattr(F, "_emit_tokenize", boom)
        F._install_trace_context()

        def call():
            th = asyncio.run(serving.BaseServing._get_trace_headers(object(), {}))
            return th["traceparent"]
        expected = tp
    elif hook == "output":
        monkeypatch.setattr(op.OutputProcessor, "do_tracing", lambda self, o, r, i: "vllm's")
        monkeypatch.setattr(F, "_emit_output", boom)
        F._install_output()

        def call():
            return op.OutputProcessor.do_tracing(object(), NS(), NS(stats=NS()), NS())
        expected = "vllm's"
    else:
        monkeypatch.setattr(H, "_on_first_bytes", boom)
        monkeypatch.setattr(H, "LIVE", [True])

        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"id": "cmpl-1"}', "more_body": False})

        def call():
            sent = []

            async def receive():
                return {"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}

            async def send(msg):
                sent.append(msg.get("body", b""))
            scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                     "headers": [(b"traceparent", tp.encode())]}
            asyncio.run(H.ClientTTFTMiddleware(app)(scope, receive, send))
            return sent
        expected = [b"", b'{"id": "cmpl-1"}']
    with caplog.at_level(logging.ERROR, logger="vllm.ttftscope"):
        for _ in range(3):
            assert call() == expected, "vLLM's own result, every time"
    failures = [r for r in caplog.records if "failed and is now disabled" in r.getMessage()]
    assert len(failures) == 1 and hook in failures[0].getMessage(), [r.getMessage() for r in caplog.records]
    assert len(raised) == 1, "the hook stays off after it failed"


def test_an_output_that_takes_no_attribute_goes_unstamped_and_the_step_is_still_kept():
    """A scheduler output with slots (a future vLLM's) cannot carry the step number to the
    workers: the step is bookkept all the same, and stamping is not tried again."""
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP

    class Slotted:
        __slots__ = ("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                     "total_num_scheduled_tokens")

        def __init__(self) -> None:
            self.scheduled_new_reqs, self.num_scheduled_tokens, self.total_num_scheduled_tokens = [], {"a": 1}, 1
            self.scheduled_cached_reqs = NO_CACHED

    st = SP.EngineState()
    sched = SimpleNamespace(running=[1], waiting=[], max_num_running_reqs=8, _inflight_prefills=set())
    for i in range(2):
        out = Slotted()
        E._on_schedule(st, sched, out, 1.0 + i, 1.001 + i)
        E._on_step_done(st, sched, out, 1.010 + i, 1.012 + i)
    assert st.stamp is False and st.step == 2 and len(st.log) == 2


@pytest.mark.parametrize("eager, tp, profile_every, stamped", [
    (False, 1, 0, False), (False, 2, 0, False),  # vLLM's default (compiled): the workers time nothing per step
    (True, 1, 0, False), (True, 2, 0, True),  # eager TP 2: collectives timed per call, under the step's number
    (False, 1, 50, True),  # profiler windows: named by the step's number
])
def test_outputs_carry_the_step_number_only_where_the_workers_use_it(monkeypatch, eager, tp, profile_every, stamped):
    """The engine-ready hook decides, once the engine's configuration is final, whether the
    scheduler's outputs take our step number: an attribute written on the engine loop every
    watched step (and pickled to every worker with TP > 1) is written only where the workers
    time something under it; until then, every output is stamped."""
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from vllm.config.compilation import CompilationMode

    monkeypatch.setattr(E, "ST", SP.EngineState())
    monkeypatch.setattr(RT, "config", dataclasses.replace(RT.config, profile_every=profile_every))
    sched = SimpleNamespace(running=[1], waiting=[], max_num_running_reqs=8, _inflight_prefills=set())

    def one_step() -> SimpleNamespace:
        out = SimpleNamespace(finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[], num_scheduled_tokens={"a": 1}, total_num_scheduled_tokens=1)
        E._on_schedule(E.ST, sched, out, 1.0, 1.001)
        E._on_step_done(E.ST, sched, out, 1.010, 1.012)
        return out

    assert one_step()._ttftscope_step == 1, "before the engine is ready: stamped"
    mode = CompilationMode.NONE if eager else CompilationMode.VLLM_COMPILE
    core = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(mode=mode, cudagraph_mode=None),
                                                       parallel_config=SimpleNamespace(tensor_parallel_size=tp)))
    E._decide_stamp(core)
    out = one_step()
    assert hasattr(out, "_ttftscope_step") is stamped and E.ST.step == 2, vars(out)


@pytest.mark.parametrize("name, collective", [
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, ...)", True),
    ("void vllm::cross_device_reduce_2stage<half, 8>(...)", True),  # vLLM's custom all-reduce (NVLink TP)
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", True),
    ("vllm::all_reduce", True), ("c10d::allreduce_", True), ("symm_mem::multimem_all_reduce_", True),
    ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn", False), ("aten::add_", False),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ...>>", False),
])
def test_profiled_windows_know_collective_kernels_by_name(name, collective):
    """In a sampled window of a compiled/graph step, a kernel's name is all that says it is a
    collective; vLLM's default all-reduce on NVLink GPUs names neither 'allreduce' nor 'all_reduce'."""
    from ttftscope.collector.vllm_plugin.worker import _is_collective

    assert _is_collective(name) is collective


def test_a_gloo_collective_is_one_call_from_its_op_to_its_work():
    """Where vLLM falls back to torch.distributed's gloo (seen on a 2-core VM: its ranks disagreed
    on the SHM group's name), a profiled window holds each call twice, the ``c10d`` op and gloo's
    record of the work it queued (on gloo's thread, ending after the op returned). Recorded here
    from a real TP=2 window on that path (rank 0, µs): five calls, each ending when its work does."""
    from types import SimpleNamespace as NS

    from ttftscope.collector.vllm_plugin.worker import _with_backend_work

    ev = lambda name, a, b: NS(name=name, time_range=NS(start=a, end=b))  # noqa: E731
    recorded = [(0, 450, 277, 989), (3178, 3500, 3380, 4120), (5418, 5884, 5500, 5871), (7916, 8151, 8002, 8391),
                (9230, 9636, 9309, 11332)]  # (op start, op end, work start, work end); the third work ends first
    calls = [e for a, b, c, d in recorded for e in (ev("c10d::allreduce_", a, b), ev("gloo:all_reduce", c, d))]
    got = _with_backend_work(calls[::-1])  # any order
    assert [(t0, t1) for _, (t0, t1) in got] == [(a, max(b, d)) for a, b, _, d in recorded]
    assert {e.name for e, _ in got} == {"c10d::allreduce_"}
    # without gloo (vLLM's SHM all-reduce, NCCL) every call stands alone
    alone = [ev("_C::shm_allreduce", 10 * i, 10 * i + 4) for i in range(3)]
    assert [t for _, t in _with_backend_work(alone)] == [(0, 4), (10, 14), (20, 24)]


def test_spans_count_as_settled_only_after_a_whole_export_interval_of_silence():
    """The demo, `run`, `sweep` and the tests stop vLLM once no span has arrived for a while (it
    may kill its engine core unflushed): that quiet must outlast the plugin's export interval,
    whatever OTEL_BSP_SCHEDULE_DELAY says, and the engine core's step-flush period (a decode run
    is made that much after its last step), or the last batches are cut off."""
    from ttftscope.collector.vllm_plugin.config import FOLD_EVERY_S

    from ttftscope.servers import settle_quiet_s

    for env in ({}, {"OTEL_BSP_SCHEDULE_DELAY": "5000"}, {"OTEL_BSP_SCHEDULE_DELAY": "100"}):
        c = PluginConfig.from_env(env)
        assert settle_quiet_s(env) >= c.interval_s + FOLD_EVERY_S + 1.0, env


def test_config_honours_the_standard_otel_variables():
    c = PluginConfig.from_env({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25",
                               "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_BSP_MAX_QUEUE_SIZE": "1000",
                               "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100", "OTEL_BSP_EXPORT_TIMEOUT": "5000",
                               "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert (c.sample_ratio, c.interval_s, c.max_queue, c.max_batch, c.export_timeout_s) == (0.25, 0.2, 1000, 100, 5.0)
    assert c.endpoint == "http://c:4318/v1/traces"
    own = PluginConfig.from_env({"TTFTSCOPE_SAMPLE_RATIO": "0.5", "OTEL_TRACES_SAMPLER": "always_off",
                                 "TTFTSCOPE_ENDPOINT": "http://x/v1/traces",
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://y/v1/traces"})
    assert (own.sample_ratio, own.endpoint) == (0.5, "http://x/v1/traces")
    assert PluginConfig.from_env({"OTEL_TRACES_SAMPLER": "always_off"}).sample_ratio == 0.0
    assert PluginConfig.from_env({"TTFTSCOPE_SAMPLE_RATIO": "junk"}).sample_ratio == 1.0
    assert not PluginConfig.from_env({"TTFTSCOPE_ENABLED": "off"}).enabled
    assert PluginConfig.from_env({"TTFTSCOPE_DISABLE": "output, scheduler"}).disabled == {"output", "scheduler"}
    linger = [PluginConfig.from_env({"TTFTSCOPE_EXPORT_LINGER_S": v}).export_linger_s for v in ("5", "-1", "junk")]
    assert linger == [5.0, 0.0, PluginConfig().export_linger_s], linger  # (a negative wait: none; junk: the default)
    assert PluginConfig.from_env({}).export_process, "the export sidecar is the default"
    assert not PluginConfig.from_env({"TTFTSCOPE_EXPORT_PROCESS": "0"}).export_process
    assert PluginConfig.from_env({}).steps_in_sidecar, "the sidecar sorts the engine core's steps out by default"
    assert not PluginConfig.from_env({"TTFTSCOPE_STEPS_IN_SIDECAR": "0"}).steps_in_sidecar
    quiet = [PluginConfig.from_env(e).quiet_steps for e in ({}, {"TTFTSCOPE_QUIET_STEPS": "all"},
                                                            {"TTFTSCOPE_QUIET_STEPS": "5"}, {"TTFTSCOPE_QUIET_STEPS": "-3"},
                                                            {"TTFTSCOPE_QUIET_STEPS": "junk"})]
    assert quiet == [8, None, 5, 0, 8], quiet


def _doctor(*args, env=None):
    import os

    return subprocess.run([PY, "-m", "ttftscope", "doctor", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=180, env={**os.environ, **(env or {})})


@pytest.mark.slow  # imports vLLM twice in a subprocess (as a user's doctor run does)
def test_doctor_reports_adapters_collector_and_store(collector_factory, tmp_path):
    from conftest import free_port

    dead = _doctor("--store", str(tmp_path / "s"), env={"TTFTSCOPE_ENDPOINT": f"http://127.0.0.1:{free_port()}/v1/traces"})
    assert dead.returncode == 1, dead.stdout
    assert "unreachable" in dead.stdout and "adapter scheduler" in dead.stdout
    col = collector_factory().start()
    r = _doctor("--store", col.store, env={"TTFTSCOPE_ENDPOINT": col.url + "/v1/traces",
                                           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"})
    assert r.returncode == 0, r.stdout + r.stderr
    coll = next(ln for ln in r.stdout.splitlines() if ln.startswith("collector"))
    assert " ok " in coll and "reachable" in coll and "of 4096 connections open" in coll, coll
    assert "0.1 of requests (OTEL_TRACES_SAMPLER=traceidratio)" in r.stdout
    side = next(ln for ln in r.stdout.splitlines() if ln.startswith("export sidecar"))
    assert " ok " in side and "starts" in side, side
    for a in ad.check_all():
        assert f"adapter {a.name}" in r.stdout
    assert "PROBLEM" not in r.stdout
    assert col.terminate() == 0


def test_decode_steps_merge_into_runs_and_prefill_steps_stand_alone(monkeypatch):
    """Unit level, the engine adapter's step bookkeeping (real vLLM drives it in
    test_vllm_plugin.py; here plain objects with the attributes it declares): decode-only steps
    with nobody waiting merge into one span whose counts and anatomy are the sums of its steps;
    a step with a prefill chunk closes the run and stands alone; decode steps with requests
    waiting merge into runs of their own (with the seats, and how many steps held them all),
    split where the engine loop paused (a bubble stays a gap between spans)."""
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import DeferredSpans, expand
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import Attr, SpanName

    q = DeferredSpans(tracer=None)
    monkeypatch.setattr(RT, "deferred", q)
    spans = []  # as the export thread sees them (attributes built)

    def drain() -> None:  # the step-flush thread folds the logged decode steps; the export thread builds
        with st.runs_lock:
            SP.fold_steps(st)
        spans.extend((r[0], r[1], r[2], r[3]) for r in expand(q.take(len(q))))
    st = SP.EngineState()
    tp = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    req = NS(request_id="cmpl-1-0-deadbeef", external_req_id="cmpl-1-0", trace_headers=tp, num_computed_tokens=0,
             num_prompt_tokens=100, prompt_token_ids=list(range(100)), priority=0, prefill_stats=None)
    sched = NS(requests={"cmpl-1-0-deadbeef": req}, running=[1, 2, 3], waiting=[], max_num_running_reqs=256, block_size=128,
               _inflight_prefills=set())

    def step(t: float, tokens: dict, new=(), waiting=0, sch=0.001, exe=0.010, upd=0.002):
        out = NS(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                 finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[NS(req_id=r, num_computed_tokens=sched.requests[r].num_computed_tokens) for r in new])
        sched.waiting = [0] * waiting
        for r, n in tokens.items():
            if r in sched.requests:
                sched.requests[r].num_computed_tokens += n
        E._on_schedule(st, sched, out, t, t + sch)
        E._on_step_done(st, sched, out, t + sch + exe, t + sch + exe + upd)
        drain()

    for i in range(10):  # decode steps 1..10, 3 running, 5 ms idle between them
        out = NS(num_scheduled_tokens={"a": 1, "b": 1, "c": 1}, finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[], total_num_scheduled_tokens=3)
        t = 1.0 + i * 0.018
        E._on_schedule(st, sched, out, t, t + 0.001)
        E._on_step_done(st, sched, out, t + 0.011, t + 0.013)
        assert len(q) == 0 and len(st.log) == 1, "a decode step is logged on the engine loop, folded off it"
        assert st.decode_run is None or st.decode_run.steps == i, "and only the fold merges it"
        drain()
    assert spans == [], "a run stays open while it grows"
    E._on_add(req, 1.95)  # r1 reaches the scheduler (queued from then until step 11 schedules it)
    queued_at = 1.95
    step(2.0, {"cmpl-1-0-deadbeef": 100, "a": 1}, new=["cmpl-1-0-deadbeef"])  # step 11: a prefill chunk closes the run
    sched.max_num_running_reqs = 3  # every seat held by the three running
    step(2.1, {"a": 1, "b": 1}, waiting=2)  # step 12: somebody waits: a run of steps with requests waiting
    step(2.1135, {"a": 1, "b": 1}, waiting=3)  # step 13, 0.5 ms after: the same run
    step(2.1365, {"a": 1, "b": 1}, waiting=1)  # step 14, after a 10 ms pause of the loop: a run of its own
    step(2.2, {"a": 1, "b": 1})  # step 15: nobody waits: the waiting run closes
    names = sorted(s[0] for s in spans)
    assert names == sorted([SpanName.STEP, SpanName.QUEUE, SpanName.PREFILL, SpanName.STEP, SpanName.STEP,
                            SpanName.STEP]), names
    by = {(s[0], s[3].get(Attr.STEP)): s for s in spans}  # the queue span has no step
    order = [(SpanName.STEP, 1), (SpanName.QUEUE, None), (SpanName.PREFILL, 11), (SpanName.STEP, 11),
             (SpanName.STEP, 12), (SpanName.STEP, 14)]
    spans = [by[k] for k in order]
    run, queue, pre, alone, waited, paused = (s[3] for s in spans)
    assert (waited[Attr.STEP], waited[Attr.STEP_LAST], waited[Attr.STEP_COUNT]) == (12, 13, 2)
    assert waited[Attr.WAITING] == 3 and waited[Attr.MAX_NUM_SEQS] == 3 and waited[Attr.STEP_FULL] == 2
    assert (paused[Attr.STEP], paused[Attr.STEP_COUNT], paused[Attr.WAITING]) == (14, 1, 1)
    assert spans[5][1] - spans[4][2] == pytest.approx(0.010, abs=1e-6), "the pause is a gap between step spans"
    assert spans[1][1:3] == (queued_at, 2.0), "queued from add_request to the schedule() that took it"
    assert queue[Attr.REQUEST_ID] == "cmpl-1-0" and queue[Attr.PRIORITY] == "0"
    assert (run[Attr.STEP], run[Attr.STEP_LAST], run[Attr.STEP_COUNT]) == (1, 10, 10)
    assert run[Attr.STEP_DECODE_TOKENS] == 30 and run[Attr.WAITING] == 0
    assert run[Attr.STEP_EXECUTE_NS] == pytest.approx(10 * 10_000_000, rel=1e-6)
    assert run[Attr.STEP_SCHEDULE_NS] == pytest.approx(10 * 1_000_000, rel=1e-6)
    assert run[Attr.STEP_IDLE_NS] == pytest.approx(9 * 5_000_000, rel=1e-4), "idle between the run's steps"
    assert spans[0][1] == 1.0 and spans[0][2] == pytest.approx(1.0 + 9 * 0.018 + 0.013)
    assert (pre[Attr.STEP], pre[Attr.CHUNK], pre[Attr.TOKENS_COMPUTED], pre[Attr.REQUEST_ID]) == (11, 0, 100, "cmpl-1-0")
    assert alone[Attr.STEP] == 11 and alone[Attr.STEP_PREFILL_TOKENS] == 100 and alone[Attr.STEP_DECODE_TOKENS] == 1


@pytest.mark.parametrize("where", ["in-vllms-process", "in-the-export-sidecar", "in-the-export-sidecar-few-running"])
def test_prompt_chunks_are_sorted_out_off_the_engine_loop(monkeypatch, where):
    """Unit level (real vLLM drives it in test_vllm_plugin.py and the truth tests): on the engine
    loop the hooks keep references only — no request's prompt, trace headers or counts are read
    there —, and the step-flush thread sorts out each step's prompt tokens from the output's own
    snapshots, as vLLM's scheduler leaves them: a 2,049-token prompt in three chunks (1,024,
    1,024, then a single token beside a decode), and a short prompt admitted with the second
    chunk that finishes in that step (vLLM frees it and takes its prefill stats before the
    hook runs) with 16 of its tokens from the prefix cache. ``in-the-export-sidecar``: the same
    steps handed over as the step-flush thread does where there is a sidecar (one record a
    second, written into a real frame with vLLM's objects as their plain values, read back), and
    sorted out there: the same spans. A prompt step hands over the snapshots of its requests in
    prompt work only, or (``few-running``: fewer running beside its new requests than
    ``WHOLE_BELOW``) all of them."""
    import dataclasses
    import pickle
    from types import SimpleNamespace as NS

    from ttftscope.collector import handoff
    from ttftscope.collector.otel_setup import READ_OUT, STEP_LOG, DeferredSpans, expand, read_out
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin import steps_handoff as SH
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import Attr, SpanName

    q = DeferredSpans(tracer=None)
    monkeypatch.setattr(RT, "deferred", q)
    on_loop, touched = [False], []
    tp = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}

    class Req:  # vLLM's Request, as far as the hooks go; its per-request reads are watched
        def __init__(self, rid: str, prompt: int, cached: int, hashed: int = 0) -> None:
            self.request_id, self.external_req_id, self.num_computed_tokens = rid, rid[:-9], cached
            self._tp, self._toks = tp, list(range(prompt))
            # vLLM's own block hashes (prefix caching on), ``hashed`` of them: its whole blocks,
            # and perhaps its output's after them
            self._bh = [hashlib.sha256(f"{rid}{i}".encode()).digest() for i in range(hashed)]
            self.prefill_stats = Stats(num_prompt_tokens=prompt, num_cached_tokens=cached)
            self.num_output_tokens = 0  # (read on the loop only in a step that resumes it after a preemption)

        @property
        def num_tokens(self) -> int:  # prompt and output
            return len(self._toks) + self.num_output_tokens

        def _read(self, what: str, value):
            if on_loop[0]:
                touched.append((self.request_id, what))
            return value

        trace_headers = property(lambda self: self._read("trace_headers", self._tp))
        prompt_token_ids = property(lambda self: self._read("prompt_token_ids", self._toks))
        num_prompt_tokens = property(lambda self: self._read("num_prompt_tokens", len(self._toks)))
        priority = property(lambda self: self._read("priority", 0))
        block_hashes = property(lambda self: self._read("block_hashes", self._bh))

    class Stats(NS):  # vLLM's PrefillStats
        pass

    class Sched(NS):  # vLLM's scheduler
        pass

    sched = Sched(requests={}, running=[], waiting=[], max_num_running_reqs=8, block_size=16, hash_block_size=16,
                  _inflight_prefills=set())
    st = SP.EngineState()
    if where != "in-vllms-process":  # as the scheduler adapter registers vLLM's classes
        if where == "in-the-export-sidecar":
            monkeypatch.setattr(SH, "WHOLE_BELOW", 1)  # (one decode runs beside: as if it were many)
        monkeypatch.setattr(handoff, "PLAIN", {Req: SH._plain_request, Stats: SH._plain_stats,
                                               Sched: SH._plain_scheduler})
        monkeypatch.setattr(RT, "processor", NS(link=NS(broken=False)))
        assert SH.ships()
        with monkeypatch.context() as m:  # (TTFTSCOPE_STEPS_IN_SIDECAR=0, or a sidecar that broke: sorted out here)
            m.setattr(RT, "config", dataclasses.replace(RT.config, steps_in_sidecar=False))
            assert not SH.ships()
            m.undo()
            m.setattr(RT, "processor", NS(link=NS(broken=True)))
            assert not SH.ships()
        assert SH.ships()

    def step(t: float, tokens: dict, new=(), finished=(), resumed=(), aborted=()) -> None:
        """vLLM's schedule(): snapshots, then the requests advanced; update_from_output() frees
        what finished; our hooks around both, on the 'loop'. ``resumed``: requests back from
        preemption, among the cached ones (vLLM's V1 model runner); ``aborted``: requests that
        went away since the step before (the output's ``finished_req_ids``)."""
        for r in new:
            sched.requests[r.request_id] = r
            E._on_add(r, t - 0.05)
        rq = sched.requests
        cached_ids = [i for i in tokens if i not in {r.request_id for r in new}]
        out = NS(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                 scheduled_new_reqs=[NS(req_id=r.request_id, num_computed_tokens=r.num_computed_tokens) for r in new],
                 finished_req_ids=set(aborted),
                 scheduled_cached_reqs=NS(req_ids=cached_ids, num_computed_tokens=[rq[i].num_computed_tokens
                                                                                 for i in cached_ids],
                                          resumed_req_ids=set(resumed)))
        for i, n in tokens.items():
            r = rq[i]
            r.num_computed_tokens += n
            (sched._inflight_prefills.add if r.num_computed_tokens < r.num_tokens else sched._inflight_prefills.discard)(r)
        on_loop[0] = True
        E._on_schedule(st, sched, out, t, t + 0.001)
        on_loop[0] = False
        for i in finished:
            rq.pop(i).prefill_stats = None
        on_loop[0] = True
        E._on_step_done(st, sched, out, t + 0.010, t + 0.011)
        on_loop[0] = False

    dec = Req("dec-0-deadbeef", 8, 0)
    dec.num_computed_tokens, dec.num_output_tokens = 9, 2  # a running request, decoding
    sched.requests[dec.request_id] = dec
    long, short = Req("long-0-deadbeef", 2049, 0, hashed=128), Req("short-0-deadbeef", 40, 16)
    step(1.0, {"long-0-deadbeef": 1024}, new=[long])
    step(1.1, {"long-0-deadbeef": 1024, "short-0-deadbeef": 24}, new=[short], finished=["short-0-deadbeef"])
    step(1.2, {"long-0-deadbeef": 1, "dec-0-deadbeef": 1})
    step(1.3, {"long-0-deadbeef": 1, "dec-0-deadbeef": 1})  # decoding now
    monkeypatch.setattr(SP, "STALE_PREFILL_STEPS", 2)
    gone = Req("gone-0-deadbeef", 3000, 0)
    step(1.4, {"gone-0-deadbeef": 1024, "dec-0-deadbeef": 1}, new=[gone])
    sched.requests.pop(gone.request_id)  # aborted mid-prefill: vLLM says so in the next step's output
    sched._inflight_prefills.discard(gone)
    step(1.5, {"dec-0-deadbeef": 1}, aborted=[gone.request_id])
    step(1.6, {"dec-0-deadbeef": 1})
    late = Req("late-0-deadbeef", 20, 0)
    step(1.7, {"late-0-deadbeef": 20, "dec-0-deadbeef": 1}, new=[late])
    # preempted mid-prefill (as seen on real vLLM with a small KV cache): vLLM drops what it had
    # computed and puts it back to wait; resumed, its first whole block is a prefix-cache hit
    # and it comes back among the cached requests, with no prefill in progress before the step
    pre = Req("pre-0-deadbeef", 300, 0, hashed=25)  # 18 whole blocks of prompt, 7 of output
    pre_hashes = pre._bh
    step(1.8, {"pre-0-deadbeef": 157, "dec-0-deadbeef": 1}, new=[pre])
    pre.num_computed_tokens = 0
    sched._inflight_prefills.discard(pre)
    step(1.9, {"dec-0-deadbeef": 1})
    step(1.91, {"dec-0-deadbeef": 1})
    # it waits for blocks longer than a prefill in progress may go without a chunk (STALE_PREFILL_STEPS,
    # 2 here): where vLLM cannot be asked whether it is gone (the sidecar), it must not be let go
    mid = Req("mid-0-deadbeef", 20, 0)
    step(1.92, {"mid-0-deadbeef": 20, "dec-0-deadbeef": 1}, new=[mid])
    pre.num_computed_tokens = 128
    step(2.0, {"pre-0-deadbeef": 126, "dec-0-deadbeef": 1}, resumed=["pre-0-deadbeef"])
    step(2.1, {"pre-0-deadbeef": 46, "dec-0-deadbeef": 1})
    # preempted in its decode, 20 tokens generated: resumed, its prompt and output are computed
    # again (16 kept by the prefix cache), 8 then 4 tokens; the step that ends it samples a token
    dec.num_computed_tokens, dec.num_output_tokens = 16, 20
    step(2.2, {"dec-0-deadbeef": 8}, resumed=["dec-0-deadbeef"])
    step(2.3, {"dec-0-deadbeef": 4})
    dec.num_output_tokens += 1
    step(2.4, {"dec-0-deadbeef": 1})
    assert touched == [], "no request's own fields read on the engine loop"
    assert len(q) == 0, "nothing built on the loop: the steps wait in the log"
    if where == "in-vllms-process":
        SP.flush_decode_run(st)
    else:
        SH.ship_steps(st, final=True)
        shipped = q.take(len(q))
        assert len(shipped) == 1 and not st.log, "the whole log handed over as one record"
        frame = handoff.dump_frame(([], [(0, shipped)], b""))  # the export thread writes the frame...
        assert touched == [], "nothing of a request read as the log is handed over, before the frame is written"
        (_, ((_, got),), _) = pickle.loads(bytes(frame[4:]))  # ... the sidecar reads it
        assert {type(x).__name__ for r in got for it in r[3][1] if it and len(it) == 10
                for x in (it[5], *(a[1] for a in it[0][3] or ()))} == {"PlainScheduler", "PlainRequest"}
        # of the output's per-request snapshots, a prompt step hands over those of the requests in
        # prompt work only (admitted, resumed, or in vLLM's set of prefills in progress before it):
        # the running decode's are O(running) a prompt step, read by nothing there
        work = [it for r in got for it in r[3][1] if it and len(it) == 10]
        assert all(it[0][8] == () for it in work), "vLLM's requests in prefill before a step stay in its process"
        handed = {it[0][0]: (sorted(it[1][0] if type(it[1]) is tuple else it[1]), it[3]) for it in work}
        with_dec = {s for s, (ns, ids) in handed.items() if "dec-0-deadbeef" in ns or "dec-0-deadbeef" in ids}
        if where == "in-the-export-sidecar":
            assert with_dec == {15, 16}, handed
            assert handed[3] == (["long-0-deadbeef"], ["long-0-deadbeef"]) and handed[2][0] == ["long-0-deadbeef",
                                                                                              "short-0-deadbeef"]
        else:  # handed over whole
            assert with_dec == set(handed) - {1, 2} and {15, 16} < with_dec, handed  # (every step it ran in)
        monkeypatch.setattr(RT, "deferred", None)  # (the sidecar's: no span source of its own)
        sorter = SH.StepSorter()
        monkeypatch.setitem(READ_OUT, STEP_LOG, sorter)
        q = DeferredSpans(tracer=None)
        assert read_out(q, got) == [], "every record of the log sorted out into spans"
        st = sorter.engines[st.engine][0]
    spans = [(r[0], r[1], r[2], r[3]) for r in expand(q.take(len(q)))]
    pre = sorted((s[3][Attr.REQUEST_ID], s[3][Attr.CHUNK], s[3][Attr.STEP], s[3][Attr.TOKENS_COMPUTED],
                  s[3][Attr.TOKENS_CACHED], s[3][Attr.BATCH_SIZE]) for s in spans if s[0] == SpanName.PREFILL)
    assert pre == [("gone-0", 0, 5, 1024, 0, 2), ("late-0", 0, 8, 20, 0, 2), ("long-0", 0, 1, 1024, 0, 1),
                   ("long-0", 1, 2, 1024, 0, 2), ("long-0", 2, 3, 1, 0, 2),
                   ("mid-0", 0, 12, 20, 0, 2), ("pre-0", 0, 9, 157, 0, 2), ("pre-0", 1, 13, 126, 0, 2),
                   ("pre-0", 2, 14, 46, 0, 2), ("short-0", 0, 2, 24, 16, 2)], pre
    # the prompt's prefix: vLLM's own block hashes where it made them (16-token blocks, up to
    # PREFIX_MAX_BLOCKS, the prompt's only), else the plugin's of its token ids (64-token blocks)
    from ttftscope.collector.vllm_plugin.prefix import PrefixHashes
    from ttftscope.schemas.vocabulary import PREFIX_BLOCK, PREFIX_MAX_BLOCKS

    prefix = {s[3][Attr.REQUEST_ID]: (str(s[3][Attr.PREFIX_HASH]), str(s[3][Attr.PREFIX_CHAIN]),
                                      s[3][Attr.PREFIX_BLOCK_TOKENS])
              for s in spans if s[0] == SpanName.PREFILL and Attr.PREFIX_HASH in s[3]}
    assert prefix == {
        "long-0": (long._bh[0][:6].hex(), ",".join(h[:6].hex() for h in long._bh[:PREFIX_MAX_BLOCKS]), 16),
        "pre-0": (pre_hashes[0][:6].hex(), ",".join(h[:6].hex() for h in pre_hashes[:300 // 16]), 16),
        "gone-0": (str(p := PrefixHashes(gone._toks)), str(p.chain), PREFIX_BLOCK)}, prefix
    resumed = [(s[3][Attr.REQUEST_ID], s[3][Attr.CHUNK]) for s in spans
               if s[0] == SpanName.PREFILL and s[3].get(Attr.PREFILL_RESUMED)]
    assert resumed == [("pre-0", 1)], "the chunk after a preemption says so (the wait before it was the preemption's)"
    queued = sorted((s[3][Attr.REQUEST_ID], s[1], s[2]) for s in spans if s[0] == SpanName.QUEUE)
    assert [q[0] for q in queued] == ["gone-0", "late-0", "long-0", "mid-0", "pre-0", "short-0"], "queued once each"
    assert queued[2:3] + queued[5:] == [("long-0", 0.95, 1.0), ("short-0", pytest.approx(1.05), 1.1)]
    steps = sorted((s[3][Attr.STEP], s[3].get(Attr.STEP_LAST), s[3][Attr.STEP_PREFILL_TOKENS],
                    s[3][Attr.STEP_DECODE_TOKENS]) for s in spans if s[0] == SpanName.STEP)
    assert steps == [(1, None, 1024, 0), (2, None, 1048, 0), (3, None, 1, 1), (4, 4, 0, 2),
                     (5, None, 1024, 1), (6, 7, 0, 2), (8, None, 20, 1), (9, None, 157, 1), (10, 11, 0, 2),
                     (12, None, 20, 1), (13, None, 126, 1), (14, None, 46, 1), (15, None, 8, 0), (16, None, 3, 1),
                     (17, 17, 0, 1)], steps
    recomputed = {s[3][Attr.STEP]: s[3][Attr.STEP_RECOMPUTE_TOKENS] for s in spans
                  if s[0] == SpanName.STEP and Attr.STEP_RECOMPUTE_TOKENS in s[3]}
    assert recomputed == {15: 8, 16: 3}, "the recompute is prefill-shaped work of no request's prefill"
    assert st.chunks == {} and not st.recomputes and not st.after_prompt, \
        "every prefill and recompute sorted out to its end, the aborted one let go (vLLM said so)"


def test_intake_and_queue_are_made_at_the_first_schedule_once_and_prompts_let_go_when_backed_up(monkeypatch):
    """Unit level, the engine adapter's admission (real vLLM drives it in test_vllm_plugin.py):
    add_request only stamps the request; its first schedule makes the intake span (the API
    server's handoff -> the scheduler had it, with the input thread's share) and the queue span;
    a request scheduled as new again (resumed after preemption) is not queued twice; a request
    the sampler dropped makes none; with the export queue half full, the step's prompt is
    hashed at once and let go."""
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import DeferredSpans, expand
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import HANDOFF_HEADER, Attr, SpanName

    q = DeferredSpans(tracer=None, max_queue=8)
    monkeypatch.setattr(RT, "deferred", q)
    st = SP.EngineState()
    on = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"

    def req(i: int, flags: str = "01") -> NS:
        r = NS(request_id=f"cmpl-{i}-0-deadbeef", external_req_id=f"cmpl-{i}-0", num_computed_tokens=0,
               trace_headers={"traceparent": on[:-2] + flags, HANDOFF_HEADER: "9.5"}, num_prompt_tokens=100,
               prompt_token_ids=list(range(100)), priority=2, prefill_stats=None)
        setattr(r, SP.RECEIVED, 9.8)  # the engine-input adapter's stamp
        E._on_add(r, 10.0)
        return r

    sched = NS(requests={}, running=[], waiting=[], max_num_running_reqs=4, block_size=16, _inflight_prefills=set())

    def step(t: float, reqs) -> list[tuple]:
        tokens = {r.request_id: 100 for r in reqs}
        out = NS(num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()),
                 finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[NS(req_id=r.request_id, num_computed_tokens=r.num_computed_tokens) for r in reqs])
        for r in reqs:
            sched.requests[r.request_id] = r
            r.num_computed_tokens = 100
        E._on_schedule(st, sched, out, t, t + 0.001)
        E._on_step_done(st, sched, out, t + 0.01, t + 0.011)
        with st.runs_lock:  # the step-flush thread sorts the step out
            SP.fold_steps(st)
        return [(r[0], r[1], r[2], r[3]) for r in expand(q.take(len(q)))]

    r1, dropped = req(1), req(2, "00")
    spans = step(10.5, [r1, dropped])
    kinds = sorted(s[0] for s in spans)
    assert kinds == sorted([SpanName.INTAKE, SpanName.QUEUE, SpanName.PREFILL, SpanName.STEP]), kinds
    intake = next(s for s in spans if s[0] == SpanName.INTAKE)
    queue = next(s for s in spans if s[0] == SpanName.QUEUE)
    assert intake[1:3] == (9.5, 10.0) and intake[3][Attr.INTAKE_IPC_NS] == pytest.approx(0.3e9)
    assert queue[1:3] == (10.0, 10.5) and queue[3][Attr.REQUEST_ID] == "cmpl-1-0" and queue[3][Attr.PRIORITY] == "2"
    prefill = next(s for s in spans if s[0] == SpanName.PREFILL)
    assert len(prefill[3][Attr.PREFIX_HASH].toks) == 100, "not hashed on the engine loop while the queue has room"
    r1.num_computed_tokens = 0  # preempted, then scheduled as new again
    again = step(11.0, [r1])
    assert sorted(s[0] for s in again) == sorted([SpanName.PREFILL, SpanName.STEP]), "queued once"

    for _ in range(4):  # the collector down: the export queue half full
        q.add("filler", 1.0, 2.0, {})
    r3 = req(3)
    step_out = NS(num_scheduled_tokens={r3.request_id: 100},
                  finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[NS(req_id=r3.request_id, num_computed_tokens=0)],
                  total_num_scheduled_tokens=100)
    sched.requests[r3.request_id] = r3
    r3.num_computed_tokens = 100
    E._on_schedule(st, sched, step_out, 12.0, 12.001)
    E._on_step_done(st, sched, step_out, 12.01, 12.011)
    with st.runs_lock:
        SP.fold_steps(st)
    held = [c for rec in q.take(len(q)) if rec[0] is None for c in rec[3][1][SP.WORK_ARG][0]]
    assert len(held) == 1 and held[0][6] is not None and held[0][6].toks == (), "hashed at once, the prompt let go"


def test_with_async_scheduling_a_step_executes_from_when_the_one_before_is_back(monkeypatch):
    """Unit level, vLLM's async scheduling (its default on GPU; real vLLM drives it in
    test_vllm_plugin.py): the engine core schedules step k+1 while the workers run step k, and
    processes k's output after that. The workers run the steps in order, so k+1 executes from
    when k is back (k's update starts), not from its own schedule: its prefill chunk's span does
    not cover the chunk before it (they overlapped, up to twice the prefill's wall time summed),
    its anatomy's execute is the workers' time, and the host time that ran while a step was in
    flight (k+1's schedule, k's update) is marked hidden. The same steps in vLLM's synchronous
    order come out as before."""
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import DeferredSpans, expand
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import Attr, SpanName

    tp = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}

    def run(order: list[tuple[str, int, float]]) -> tuple[dict, dict]:
        q = DeferredSpans(tracer=None)
        monkeypatch.setattr(RT, "deferred", q)
        st = SP.EngineState()
        sched = NS(requests={}, running=[], waiting=[], max_num_running_reqs=4, block_size=16,
                   _inflight_prefills=set())
        outs = {}
        for what, k, t in order:
            if what == "schedule":  # step k admits request k whole (100 prompt tokens)
                r = NS(request_id=f"r{k}", external_req_id=f"r{k}", num_computed_tokens=0, trace_headers=tp,
                       num_prompt_tokens=100, prompt_token_ids=list(range(100)), priority=0, prefill_stats=None)
                E._on_add(r, t - 0.5)
                sched.requests[r.request_id] = r
                outs[k] = NS(num_scheduled_tokens={r.request_id: 100}, total_num_scheduled_tokens=100,
                             finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[NS(req_id=r.request_id, num_computed_tokens=0)])
                r.num_computed_tokens = 100
                E._on_schedule(st, sched, outs[k], t, t + 0.001)
            else:
                E._on_step_done(st, sched, outs[k], t, t + 0.001)
        with st.runs_lock:
            SP.fold_steps(st)
        spans = [(r[0], r[1], r[2], r[3]) for r in expand(q.take(len(q)))]
        prefill = {s[3][Attr.STEP]: (s[1], s[2]) for s in spans if s[0] == SpanName.PREFILL}
        steps = {s[3][Attr.STEP]: s[3] for s in spans if s[0] == SpanName.STEP}
        return prefill, steps

    # async: schedule 1, schedule 2 (the queue of two full), 1 back, schedule 3, 2 back, 3 back
    prefill, steps = run([("schedule", 1, 10.000), ("schedule", 2, 10.002), ("done", 1, 10.020),
                          ("schedule", 3, 10.022), ("done", 2, 10.040), ("done", 3, 10.060)])
    assert prefill == {1: (10.001, 10.020), 2: (10.020, 10.040), 3: (10.040, 10.060)}, prefill
    assert [steps[k][Attr.STEP_EXECUTE_NS] for k in (1, 2, 3)] == [pytest.approx(19e6, abs=2),
                                                                   pytest.approx(20e6, abs=2),
                                                                   pytest.approx(20e6, abs=2)]
    assert steps[1].get(Attr.STEP_HOST_HIDDEN_NS, 0) == 0, "step 1 waited for nothing: its host time held the workers"
    assert steps[2][Attr.STEP_HOST_HIDDEN_NS] == pytest.approx(2e6, abs=2), \
        "its schedule (1 ms) ran behind step 1, and step 1's update (1 ms) behind it"
    # synchronous (vLLM on CPU, or async scheduling off): schedule, run, update, one step at a time
    prefill, steps = run([("schedule", 1, 10.000), ("done", 1, 10.020), ("schedule", 2, 10.022),
                          ("done", 2, 10.040), ("schedule", 3, 10.042), ("done", 3, 10.060)])
    assert prefill == {1: (10.001, 10.020), 2: (10.023, 10.040), 3: (10.043, 10.060)}, prefill
    assert all(Attr.STEP_HOST_HIDDEN_NS not in a for a in steps.values())


def test_the_first_tokens_time_follows_a_step_of_the_wall_clock(monkeypatch):
    """vLLM stamps the first token on the monotonic clock; the deliver span starts there, on the
    wall clock. The wall clock can step after vLLM started (NTP, a VM's clock sync: 132 ms seen in
    one slow-tier run here, every deliver span then starting before its request arrived): the
    conversion must use the offset of now, not the one at start-up."""
    import time
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import attributes
    from ttftscope.collector.vllm_plugin import frontend as F
    from ttftscope.collector.vllm_plugin import http as H
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import SpanName

    spans = []
    monkeypatch.setattr(RT, "deferred", NS(add=lambda name, s, e, attrs, parent=None:
                                           spans.append((name, s, e, attributes(attrs)))))
    monkeypatch.setattr(H, "ACTIVE", [False])  # no middleware: deliver ends when the output was handled
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 0.132)  # the wall clock stepped 132 ms forward
    now = time.time()
    stats = NS(first_token_ts=time.monotonic() - 0.010, arrival_time=now - 0.030, first_token_latency=0.025)
    out = NS(trace_headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
    F._emit_output(out, NS(stats=stats, external_req_id="cmpl-9"))
    (deliver,) = [s for s in spans if s[0] == SpanName.DELIVER]
    assert abs(deliver[1] - (now - 0.010)) < 0.002, (deliver[1] - now, "produced 10 ms ago, on today's wall clock")


def test_the_middleware_sets_apart_a_streams_wait_for_a_token_with_text(monkeypatch):
    """Unit level, the ASGI middleware on a small app standing in for vLLM's streaming route
    (real vLLM drives it in tests/truth/test_client_ttft.py): the first chunk carries a token that decodes
    to no text, the one with text comes 40 ms later (the next decode step). TTFT ends at the
    chunk with text, and the http span says how long the stream waited for it."""
    import asyncio
    import time
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import attributes
    from ttftscope.collector.vllm_plugin import http as H
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import Attr, SpanName

    spans = []  # as the export thread sees them (attributes built)
    monkeypatch.setattr(RT, "deferred", NS(add=lambda name, s, e, attrs, parent=None:
                                           spans.append((name, s, e, attributes(attrs)))))
    monkeypatch.setattr(H, "RDV", H.Rendezvous())
    gap_s = 0.040

    def chunk(text: str) -> bytes:
        return b"data: " + json.dumps({"id": "cmpl-7", "choices": [{"index": 0, "text": text}]}).encode() + b"\n\n"

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        await send({"type": "http.response.body", "body": chunk(""), "more_body": True})
        await asyncio.sleep(gap_s)
        await send({"type": "http.response.body", "body": chunk("Hello"), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": b'{"prompt": "x", "stream": true}', "more_body": False}

    sent, direct = [], []

    async def server_send(msg):
        sent.append(msg.get("body", b""))

    def send(msg):  # the server's send; later chunks' awaitables must be its own
        aw = server_send(msg)
        direct.append(aw)
        return aw

    class App:  # records what awaiting the middleware's send gives back
        async def __call__(self, scope, receive, send_):
            async def watched(msg):
                aw = send_(msg)
                direct_back.append(aw)
                return await aw
            await app(scope, receive, watched)

    direct_back = []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"traceparent", b"00-" + b"ab" * 16 + b"-" + b"cd" * 8 + b"-01")]}
    t0 = time.time()
    asyncio.run(H.ClientTTFTMiddleware(App())(scope, receive, send))
    assert sent == [b"", chunk(""), chunk("Hello"), b"data: [DONE]\n\n"], "every message reaches the server, in order"
    # after the chunk with text, the last one went straight through (the server's own awaitable)
    assert direct_back[-1] is direct[-1] and direct_back[1] is not direct[1]
    (http,) = [s for s in spans if s[0] == SpanName.HTTP]
    assert http[3][Attr.REQUEST_ID] == "cmpl-7" and http[3][Attr.HTTP_STREAMING] is True
    assert http[2] - t0 >= gap_s, "TTFT ends at the chunk with text"
    wait_s = http[3][Attr.HTTP_TEXT_WAIT_NS] / 1e9
    assert gap_s <= wait_s <= http[2] - http[1], (wait_s, http)
    assert http[3][Attr.HTTP_TEXT_WAIT_TOKENS] == 1


def test_a_chunks_first_token_is_read_from_its_bytes_as_a_parse_reads_it():
    """The middleware finds a stream's first token by searching the chunk's bytes (vLLM's own
    shapes), not by parsing it: on chunks serialised by vLLM's own response classes, as its
    serving code does (``model_dump_json(exclude_unset=True)``), and on chunks whose text holds
    the keys searched for, it must answer what the parse answers, and what was planted."""
    from vllm.entrypoints.generate.base.protocol import (
        DeltaFunctionCall,
        DeltaMessage,
        DeltaToolCall,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice as ChatChoice,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionStreamResponse as Chat,
    )
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice as Choice
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    def Completion(**kw):  # noqa: N802 - as vLLM's serving code makes one: id, object and created set
        return CompletionStreamResponse(object="text_completion", **kw)

    from ttftscope.collector.vllm_plugin import http as H

    tricky = 'say \\"text\\":\\"x\\" and "content":"y" \u00e9\n'
    planted = [  # (the chunk as vLLM writes it, whether it carries a token)
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text="")]), False),
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text=" hi")]), True),
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text="", token_ids=[])]), False),
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text="", token_ids=[17])]), True),
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text="", finish_reason="stop")]), True),
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text="", prompt_token_ids=[1, 2])]), False),
        (Completion(id="cmpl-3", created=1, model="m", choices=[Choice(index=0, text=tricky)]), True),
        (Completion(id="cmpl-3", created=1, model="m", choices=[]), False),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", choices=[ChatChoice(index=0, delta=DeltaMessage(role="assistant", content=""))]), False),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", choices=[ChatChoice(index=0, delta=DeltaMessage(role="assistant"))]), False),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", choices=[ChatChoice(index=0, delta=DeltaMessage(content="Hi"))]), True),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", choices=[ChatChoice(index=0, delta=DeltaMessage(reasoning="hmm"))]), True),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", choices=[ChatChoice(index=0, delta=DeltaMessage(content=""), finish_reason="length")]),
         True),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", choices=[ChatChoice(index=0, delta=DeltaMessage(tool_calls=[DeltaToolCall(
            index=0, function=DeltaFunctionCall(name="f"))]))]), True),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", prompt_text=tricky,
              choices=[ChatChoice(index=0, delta=DeltaMessage(role="assistant", content=""))]), False),
        (Chat(id="chatcmpl-4", object="chat.completion.chunk", created=1, model="m", prompt_token_ids=[5, 6],
              choices=[ChatChoice(index=0, delta=DeltaMessage(content=tricky))]), True),
    ]
    for resp, token in planted:
        data = resp.model_dump_json(exclude_unset=True).encode()
        body = b"data: " + data + b"\n\n"
        assert data.startswith(b'{"id":"') and b'"choices":[' in data, ("vLLM's shape, read without a parse", data)
        assert H._has_token(body) == H._has_token_parsed(data) == (token, resp.id, bool(resp.choices)), data
    # several events in one body, [DONE], and shapes that are parsed (the Responses API's events)
    two = (b'data: {"id":"c1","choices":[{"index":0,"text":""}]}\n\n'
           b'data: {"id":"c1","choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n')
    assert H._has_token(two) == (True, "c1", True)
    assert H._has_token(b'data: {"type":"response.output_text.delta","delta":"a"}\n\n') == (True, "", True)
    assert H._has_token(b'data: {"type":"response.created","response":{}}\n\n') == (False, "", False)
    assert H._has_token(b"data: not json\n\n") == (False, "", False)


def test_prefix_hashes_are_the_same_lazy_or_frozen_and_hold_a_bounded_prompt():
    """The engine keeps a reference to the prompt and the export thread hashes it; frozen (the
    export queue backed up) the hashes are computed at once and the prompt let go. Two prompts
    sharing their first 200 tokens share three 64-token blocks of the chain, not the fourth;
    a prompt longer than the chain's reach is held only up to it."""
    from ttftscope.collector.vllm_plugin.prefix import PrefixHashes
    from ttftscope.schemas.vocabulary import PREFIX_BLOCK, PREFIX_MAX_BLOCKS

    a = list(range(200)) + [7] * 100
    b = list(range(200)) + [9] * 100
    ha, hb = PrefixHashes(a), PrefixHashes(b)
    ca, cb = str(ha.chain).split(","), str(hb.chain).split(",")
    assert len(ca) == len(cb) == 300 // PREFIX_BLOCK
    assert ca[:3] == cb[:3] and ca[3] != cb[3]
    assert str(ha) == str(hb) and str(PrefixHashes([1] + a[1:])) != str(ha), "the first block's hash"
    fresh = PrefixHashes(a)
    assert str(fresh.freeze().chain) == str(ha.chain) and fresh.toks == ()
    long = PrefixHashes(list(range(10_000)))
    assert len(long.toks) == PREFIX_BLOCK * PREFIX_MAX_BLOCKS
    assert len(str(long.chain).split(",")) == PREFIX_MAX_BLOCKS


@pytest.mark.parametrize("eager_tp2", [False, True])
def test_quiet_steps_are_sampled_and_the_unwatched_stretch_keeps_the_engine_timeline_whole(monkeypatch, eager_tp2):
    """Decode-only steps with nobody waiting and no prefill in progress cannot delay a first
    token: after TTFTSCOPE_QUIET_STEPS of them the scheduler rests (vLLM's own methods run, bound
    on the instance: no hook of ours per step) until a request reaches the scheduler or the next
    sample is due. The stretch not watched is one ``unobserved`` span from the last watched step's
    end to the wake-up (or to the end of the step in progress, where a sample woke it during a
    step), so the engine's timeline has no false idle gap where it stepped
    unwatched. Where the workers number their steps (an eager model with TP 2), every step is
    watched. Driven through the installed wrappers on a Scheduler instance, as vLLM calls them."""
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import DeferredSpans, expand
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import SpanName
    from vllm.config.compilation import CompilationMode
    from vllm.v1.core.sched import scheduler as sched_mod
    from vllm.v1.engine import core

    S = sched_mod.Scheduler
    calls = {"schedule": 0, "update": 0}
    admit = []  # a request for the next schedule() to take

    def schedule(self, *a, **kw):  # vLLM's methods, standing in (no engine here)
        calls["schedule"] += 1
        tokens = {"a": 1, "b": 1}
        new = [NS(req_id=r.request_id, num_computed_tokens=r.num_computed_tokens) for r in admit]
        for r in admit:
            tokens[r.request_id] = r.num_prompt_tokens
            r.num_computed_tokens = r.num_prompt_tokens
        admit.clear()
        return NS(finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=new, num_scheduled_tokens=tokens, total_num_scheduled_tokens=sum(tokens.values()))

    def update(self, scheduler_output, *a, **kw):
        calls["update"] += 1
        return "updated"

    for name, fn in (("add_request", lambda self, r: None), ("schedule", schedule), ("update_from_output", update)):
        monkeypatch.setattr(S, name, fn)
    monkeypatch.setattr(core.EngineCore, "preprocess_add_request", lambda self, request: (request, 0))
    monkeypatch.setattr(RT, "config", dataclasses.replace(RT.config, quiet_steps=2, profile_every=0))
    monkeypatch.setattr(RT, "deferred", DeferredSpans(tracer=None))
    monkeypatch.setattr(E, "ST", SP.EngineState())
    sample = E.sample_quiet
    monkeypatch.setattr(E, "sample_quiet", lambda *a: None)  # the step-flush thread's ticks: called here instead
    E._install_scheduler()
    E._install_engine_input()
    me = S.__new__(S)  # a Scheduler instance with the attributes the hooks read
    mode = CompilationMode.NONE if eager_tp2 else CompilationMode.VLLM_COMPILE
    me.__dict__.update(running=[1, 2], waiting=[], max_num_running_reqs=8, requests={}, block_size=16, _inflight_prefills=set(),
                       vllm_config=NS(compilation_config=NS(mode=mode, cudagraph_mode=None),
                                      parallel_config=NS(tensor_parallel_size=2 if eager_tp2 else 1)))
    st = E.ST

    def steps(n: int) -> None:
        for _ in range(n):
            assert me.update_from_output(me.schedule()) == "updated", "vLLM's result, watched or not"

    steps(6)
    assert calls == {"schedule": 6, "update": 6}
    if eager_tp2:
        assert st.step == 6 and not st.resting and "schedule" not in vars(me), "every step watched"
        return
    assert st.step == 2 and st.resting, "two quiet steps watched, then the scheduler rests"
    assert vars(me)["schedule"].__func__ is schedule, "vLLM's own method runs, not a wrapper of ours"
    rested_from = st.gap_from
    # a request reaches the engine core's input thread while a step is in progress: the scheduler
    # wakes when the engine loop hands it over (a wake-up on the input thread cost ~3x more CPU)
    out = me.schedule()
    core.EngineCore.preprocess_add_request(object(), NS())
    assert st.resting
    me.update_from_output(out)  # vLLM's own, unwatched
    woke = E.time.time()
    me.add_request(NS())
    assert not st.resting and "schedule" not in vars(me)
    stretch_end = st.last_end
    assert woke <= stretch_end <= E.time.time() and st.step == 2
    me.waiting = [9]  # somebody waits: every step watched, whatever the sample says
    steps(3)
    assert st.step == 5 and not st.resting
    me.waiting = []
    steps(3)  # quiet again, the sample already used: one step, then rest
    assert st.step == 6 and st.resting
    between = E.time.time()
    sample(st, 2)  # the next sample is due (woken between steps)
    steps(4)
    assert st.step == 8 and st.resting
    # a request reaches the scheduler (between steps): watched from its schedule; once its prompt
    # is in and nobody waits, the scheduler rests at once (the sample is used up)
    tp = {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"}
    req = NS(request_id="cmpl-7-0-deadbeef", external_req_id="cmpl-7-0", trace_headers=tp, num_computed_tokens=0,
             num_prompt_tokens=4, prompt_token_ids=[1, 2, 3, 4], priority=0, prefill_stats=None)
    me.requests[req.request_id] = req
    E._on_add(req, E.time.time())
    assert not st.resting
    admit.append(req)
    steps(3)
    assert st.step == 9 and st.resting, "the step admitting it watched, the quiet ones after it not"
    assert calls == {"schedule": 20, "update": 20}
    assert len(RT.deferred) == 0, "nothing made on the engine loop: the stretches too are spans made off it"
    with st.runs_lock:
        SP.fold_steps(st)
    got = sorted(((r[0], r[1], r[2]) for r in expand(RT.deferred.take(len(RT.deferred)))), key=lambda r: r[1])
    assert {n for n, _, _ in got} - {SpanName.STEP, SpanName.UNOBSERVED} == {SpanName.QUEUE, SpanName.PREFILL}
    got = [g for g in got if g[0] in (SpanName.STEP, SpanName.UNOBSERVED)]
    names = [n for n, _, _ in got]
    # the first sample's run, unwatched, the steps with somebody waiting, the quiet one after them,
    # unwatched, the next sample's run, unwatched, the step admitting the request (the rest after
    # it is still open)
    assert names == [SpanName.STEP, SpanName.UNOBSERVED, SpanName.STEP, SpanName.STEP, SpanName.UNOBSERVED,
                     SpanName.STEP, SpanName.UNOBSERVED, SpanName.STEP], names
    first_run, gap1, _, quiet, gap2, sampled, gap3, admitted = got
    assert gap1[1] == rested_from == first_run[2], "the stretch starts where the last watched step ended"
    assert gap1[2] == stretch_end, "and ends when the scheduler had a request"
    assert gap2[1] == quiet[2] and between <= gap2[2] <= sampled[1], "woken between steps: to the wake-up"
    assert gap3[1] == sampled[2] and gap3[2] <= admitted[1]
    for a, b in zip(got, got[1:], strict=False):
        assert b[1] >= a[2] - 1e-9, ("spans in order, none overlapping", a, b)


@pytest.mark.parametrize("override", ["schedule", "update_from_output", "wrapped-after"])
def test_a_scheduler_subclass_with_its_own_step_methods_never_rests(monkeypatch, override):
    """Resting binds vLLM's base ``Scheduler`` methods on the instance: on a subclass that
    overrides one of them (vLLM's own ``DiffusionScheduler`` overrides ``schedule``; a
    ``--scheduler-cls`` of the user's may), that would skip the override — the server would
    schedule as another scheduler. Such a scheduler is never rested: its override runs every
    step, every step is watched."""
    from types import SimpleNamespace as NS

    from ttftscope.collector.otel_setup import DeferredSpans
    from ttftscope.collector.vllm_plugin import engine as E
    from ttftscope.collector.vllm_plugin import steps as SP
    from ttftscope.collector.vllm_plugin.runtime import RT
    from vllm.config.compilation import CompilationMode
    from vllm.v1.core.sched import scheduler as sched_mod

    S = sched_mod.Scheduler
    for name, fn in (("add_request", lambda self, r: None),
                     ("schedule", lambda self, *a, **kw: NS(finished_req_ids=set(), scheduled_cached_reqs=NO_CACHED, scheduled_new_reqs=[], num_scheduled_tokens={"a": 1},
                                                            total_num_scheduled_tokens=1)),
                     ("update_from_output", lambda self, out, *a, **kw: "updated")):
        monkeypatch.setattr(S, name, fn)  # vLLM's methods, standing in (no engine here)
    monkeypatch.setattr(RT, "config", dataclasses.replace(RT.config, quiet_steps=2, profile_every=0))
    monkeypatch.setattr(RT, "deferred", DeferredSpans(tracer=None))
    monkeypatch.setattr(E, "ST", SP.EngineState())
    E._install_scheduler()
    ran = []

    class Mine(S):  # defined after the plugin installed its wrappers, as vLLM's subclasses are
        pass

    def own(self, *a, **kw):
        ran.append(override)
        return getattr(super(Mine, self), override)(*a, **kw)

    if override == "wrapped-after":  # another plugin wraps vLLM's schedule after ours, on the base class
        ours = S.schedule

        def theirs(self, *a, **kw):
            ran.append(override)
            return ours(self, *a, **kw)

        monkeypatch.setattr(S, "schedule", theirs)
    else:
        setattr(Mine, override, own)
    me = Mine.__new__(Mine)
    me.__dict__.update(running=[1], waiting=[], max_num_running_reqs=8, requests={}, block_size=16, _inflight_prefills=set(),
                       vllm_config=NS(compilation_config=NS(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=None),
                                      parallel_config=NS(tensor_parallel_size=1)))
    for _ in range(8):
        assert me.update_from_output(me.schedule()) == "updated"
    assert ran == [override] * 8, "the subclass's own method ran every step"
    assert E.ST.step == 8 and not E.ST.resting and "schedule" not in vars(me), "every step watched"
    if override == "wrapped-after":
        return
    # the same steps on the base class rest after the sample (the rule is about the override)
    base = S.__new__(S)
    base.__dict__.update(me.__dict__)
    monkeypatch.setattr(E, "ST", SP.EngineState(wrappers=E.ST.wrappers, rest=E.ST.rest, quiet_left=2))
    for _ in range(4):
        base.update_from_output(base.schedule())
    assert E.ST.resting and E.ST.step == 2
