"""The export sidecar (``collector.handoff``): the plugin's records leave the serving process
as they are and a child process builds, encodes and posts them. Checked against the
in-process export (itself checked against the OpenTelemetry SDK's encoder in
test_plugin_export) into a real collector, and through the ways a child process fails: killed,
never started, stopped with a full pipe, sent SIGTERM with the rest of the process group."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, ttftscope_sql
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from ttftscope.collector import handoff
from ttftscope.collector.otel_setup import BoundedBatchSpanProcessor, DeferredSpans
from ttftscope.collector.span_wire import OtlpHttpPoster
from ttftscope.collector.vllm_plugin import steps as SP
from ttftscope.collector.vllm_plugin import steps_handoff as SH
from ttftscope.collector.vllm_plugin.prefix import PrefixHashes
from ttftscope.schemas.vocabulary import PREFIX_BLOCK, PREFIX_MAX_BLOCKS

T0 = 1_700_000_000.0
TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class TokenList(list):
    """Stands for vLLM's own token-list type: a class the sidecar cannot import (this test
    module is not on its path), so a prompt handed over as this type would be lost there."""


def _pipeline(url: str, service: str, sidecar: bool, **kw):
    resource = Resource.create({"service.name": service, "ttftscope.process.role": "engine_core"})
    provider = TracerProvider(resource=resource)
    args = {"interval_s": 60, "poster": OtlpHttpPoster(url + "/v1/traces", timeout=5), **kw}
    exporter = OTLPSpanExporter(endpoint=url + "/v1/traces", timeout=5)
    proc = (handoff.HandoffProcessor(exporter, role="engine_core", endpoint=url + "/v1/traces", timeout_s=5, **args)
            if sidecar else BoundedBatchSpanProcessor(exporter, **args))
    provider.add_span_processor(proc)
    tracer = provider.get_tracer("t")
    ours = DeferredSpans(tracer, resource)
    vllms = DeferredSpans(tracer, resource, scope=("vllm.tracing.otel", ""), kind=SpanKind.SERVER)
    proc.add_source(ours)
    proc.add_source(vllms)
    return proc, tracer, ours, vllms


def _record_everything(tracer, ours: DeferredSpans, vllms: DeferredSpans, k: int) -> None:
    """What the plugin records in serving: an engine step's lazy group (a prefill chunk with
    its prompt's prefix hashes, a queue wait), a decode run, plain spans under a request's trace
    headers, one under an SDK span's Context (cold start), vLLM's llm_request under a Context
    with a trace state, and an SDK span of vLLM's own."""
    th = {"traceparent": TP, "x-ttftscope-handoff": "1.5"}
    toks = TokenList(range(k, k + 150))
    chunk = (f"req-{k}-abcdef12", 140, 32, 0, th, f"cmpl-{k}", PrefixHashes(toks), 16, False)  # an SP.Chunk
    ours.group(SP._step_spans, (k, T0 + k, T0 + k + 0.01, T0 + k + 0.01, T0 + k + 0.03, T0 + k + 0.031,
                               ([chunk], [(T0 + k - 0.2, T0 + k - 0.201, f"req-{k}-abcdef12", f"cmpl-{k}", 3, th)], 0),
                               1, 1, 2, 140, "engine-7", T0 + k - 0.004, 8))
    run = SP.DecodeRun(T0 + k + 1, T0 + k + 1.5, 40, 80, 2, 100 + k, 139 + k, 0.01, 0.4, 0.02, 0.01, 0.0, 3, 2, 5)
    ours.add("ttftscope.step", run.start, run.end, (SP._run_attrs, (run, "engine-7")))
    ours.add("ttftscope.tokenize", T0 + k, T0 + k + 0.002, {"ttftscope.phase": "tokenize", "n": k, "f": 0.25,
                                                            "b": True, "s": "é" * 3}, th)
    root = tracer.start_span("ttftscope.process", start_time=int((T0 + k) * 1e9))
    ours.add("ttftscope.load", T0 + k, T0 + k + 0.5, {"ttftscope.load.stage": "imports"},
             trace.set_span_in_context(root))
    root.end(end_time=int((T0 + k + 1) * 1e9))
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    ctx = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7 + k, is_remote=True, trace_flags=TraceFlags(1),
        trace_state=TraceState([("vendor", "v1")]))))
    vllms.add("llm_request", T0 + k, T0 + k + 0.1, {"gen_ai.usage.prompt_tokens": 150, "gen_ai.request.id": f"cmpl-{k}",
                                                   "gen_ai.latency.time_in_queue": 0.125}, ctx)


def _rows(store: str, service: str) -> list[tuple]:
    """Every span as what identifies it regardless of the random ids the encoder gives: name,
    times, kind, scope, attributes, trace state, and its parent (the given trace and parent ids,
    a new trace, or the name of the span it sits under)."""
    rows = ttftscope_sql(store, """
        SELECT SpanName, toUnixTimestamp64Nano(Timestamp) AS start, Duration, SpanKind, ScopeName, SpanAttributes AS a,
               TraceState, TraceId, ParentSpanId, SpanId, ResourceAttributes AS res
        FROM otel_traces WHERE ServiceName = {s:String}""", params={"s": service})
    by_id = {r["SpanId"]: r for r in rows}
    out = []
    for r in rows:
        parent = by_id.get(r["ParentSpanId"])
        out.append((r["SpanName"], int(r["start"]), int(r["Duration"]), r["SpanKind"], r["ScopeName"],
                    tuple(sorted(r["a"].items())), r["TraceState"],
                    (r["TraceId"] if r["TraceId"] == TP[3:35] else "new", r["ParentSpanId"]) if parent is None
                    else ("under", parent["SpanName"]),
                    r["res"]["ttftscope.process.role"]))
    return sorted(out)


def test_records_handed_to_the_sidecar_arrive_as_the_in_process_export_writes_them(collector_factory):
    col = collector_factory().start()
    for service, sidecar in (("in-process", False), ("sidecar", True)):
        proc, tracer, ours, vllms = _pipeline(col.url, service, sidecar)
        for k in range(3):
            _record_everything(tracer, ours, vllms, k)
        assert proc.force_flush() and proc.failed == 0
        if sidecar:
            pid = proc.link.proc.pid
            assert pid != os.getpid() and proc.link.starts == 1 and not proc.link.broken
            import psutil

            assert psutil.Process(pid).nice() == min(os.nice(0) + handoff.NICE, 19), "it yields to vLLM's threads"
            assert [p.pid for p in handoff.sidecars_of([os.getpid()])] == [pid], "found by the pid it names"
        proc.shutdown()
        if sidecar:
            assert proc.link.proc is None, "the sidecar left once its pipe closed and it had posted"
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    inproc, side = _rows(col.store, "in-process"), _rows(col.store, "sidecar")
    assert len(inproc) == 3 * 8, [r[0] for r in inproc]
    assert side == inproc
    prefill = [r for r in side if r[0] == "ttftscope.prefill"]
    assert all(dict(r[5])["ttftscope.prefix.hash"] for r in prefill), "the prompts' hashes were computed there"


def test_a_killed_sidecar_is_replaced_and_what_comes_after_arrives(collector_factory, caplog):
    col = collector_factory().start()
    proc, tracer, ours, vllms = _pipeline(col.url, "killed", True)
    ours.add("first", T0, T0 + 1, {"i": 1})
    assert proc.force_flush()
    first = proc.link.proc
    deadline = time.monotonic() + 30
    while col.metric("ttftscope_collector_spans_received_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the sidecar posted it (what a sidecar holds when it is killed is lost)
    first.kill()
    first.wait(10)
    ours.add("second", T0, T0 + 1, {"i": 2})
    with caplog.at_level(logging.WARNING, logger="vllm.ttftscope"):
        assert proc.force_flush()
    assert proc.link.starts == 2 and proc.link.proc.pid != first.pid
    assert f"sidecar (pid {first.pid}) exited; starting another" in caplog.text, "an operator is told"
    proc.shutdown()
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    got = ttftscope_sql(col.store, "SELECT SpanName AS n FROM otel_traces WHERE ServiceName = 'killed' ORDER BY n")
    assert [r["n"] for r in got] == ["first", "second"]


class Unreadable:
    """An attribute value of a class the sidecar cannot import (this test module is not on its
    path): the frame that carries it is one the sidecar cannot read."""


def test_a_frame_the_sidecar_cannot_read_costs_its_own_spans_only(collector_factory):
    """One bad frame costs its spans, not the source's later ones: the first frame a source is
    in is also the one that told the sidecar of it (its resource, scope and kind). When the
    sidecar named the source's descriptor once only, the next frame's spans, fine in themselves,
    were dropped as of an unknown source, and every one after them."""
    col = collector_factory().start()
    proc, tracer, ours, vllms = _pipeline(col.url, "bad-frame", True)
    ours.add("unreadable", T0, T0 + 1, {"v": Unreadable()})
    vllms.add("llm_request", T0, T0 + 1, {"i": 0})
    assert proc.force_flush()
    for k in (1, 2):
        ours.add(f"after-{k}", T0 + k, T0 + k + 1, {"i": k})
        vllms.add("llm_request", T0 + k, T0 + k + 1, {"i": k})
        assert proc.force_flush()
    assert proc.link.starts == 1, "the same sidecar read the frames after the bad one"
    proc.shutdown()
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    got = ttftscope_sql(col.store, "SELECT SpanName AS n, ScopeName AS s FROM otel_traces "
                                   "WHERE ServiceName = 'bad-frame' ORDER BY n, SpanAttributes['i']")
    assert [(r["n"], r["s"]) for r in got] == [("after-1", "ttftscope.vllm"), ("after-2", "ttftscope.vllm"),
                                               ("llm_request", "vllm.tracing.otel"),
                                               ("llm_request", "vllm.tracing.otel")]


def test_without_a_sidecar_the_export_stays_in_process(collector_factory, monkeypatch, caplog):
    """A sidecar that cannot start (here the interpreter exits at once) takes no record with it:
    the export thread encodes and posts them itself, and says so once."""
    col = collector_factory().start()
    monkeypatch.setattr(handoff.sys, "executable", "/bin/false")
    proc, tracer, ours, vllms = _pipeline(col.url, "no-sidecar", True)
    with caplog.at_level(logging.WARNING, logger="vllm.ttftscope"):
        _record_everything(tracer, ours, vllms, 0)
        assert proc.force_flush()
    assert proc.link.broken and "no export sidecar" in caplog.text
    proc.shutdown()
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    assert len(_rows(col.store, "no-sidecar")) == 8


def test_a_stopped_sidecar_costs_its_batch_not_a_blocked_export(collector_factory):
    """A sidecar that stops reading (SIGSTOP) fills its pipe: the export thread gives up on the
    frame after its timeout (counted failed: part of it may be in the pipe), lets that sidecar go
    and the next export goes to a new one."""
    col = collector_factory().start()
    proc, tracer, ours, vllms = _pipeline(col.url, "stopped", True, max_batch=512, max_queue=4096)
    proc.link.timeout_s = 1.0
    ours.add("before", T0, T0 + 1, {})
    assert proc.force_flush()
    deadline = time.monotonic() + 30
    while col.metric("ttftscope_collector_spans_received_total") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the sidecar posted it (what a sidecar holds when it is killed is lost)
    stopped = proc.link.proc
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        for i in range(512):  # ~2.5 MB in one frame: more than the pipe holds
            ours.add("big", T0, T0 + 1, {"pad": f"{i:05d}" + "x" * 5000})
        proc.force_flush()
        # gone: a stopped process leaves only when it is killed (not our child: no exit status)
        assert proc.failed == 512 and stopped.wait(10) == 0
    finally:
        if stopped.poll() is None:
            os.kill(stopped.pid, signal.SIGCONT)
    ours.add("after", T0, T0 + 1, {})
    assert proc.force_flush() and proc.link.starts == 2
    proc.shutdown()
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    got = ttftscope_sql(col.store, "SELECT SpanName AS n, count() AS c FROM otel_traces WHERE ServiceName = 'stopped' "
                                   "GROUP BY n ORDER BY n")
    assert [(r["n"], int(r["c"])) for r in got] == [("after", 1), ("before", 1)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_sidecar_still_posts_what_it_was_given(collector_factory, sig):
    """vLLM stopped with Ctrl-C or a TERM to its process group: the sidecar gets the signal too,
    keeps going, and posts everything the serving process hands over at its exit."""
    col = collector_factory().start()
    proc, tracer, ours, vllms = _pipeline(col.url, "signalled", True)
    ours.add("early", T0, T0 + 1, {})
    assert proc.force_flush()
    os.kill(proc.link.proc.pid, sig)
    time.sleep(0.3)
    assert proc.link.proc.poll() is None, "the signal did not stop it"
    for i in range(50):
        ours.add("at-exit", T0 + i, T0 + i + 1, {"i": i})
    sidecar = proc.link.proc
    proc.shutdown()  # hands the 50 over, closes the pipe, waits for the sidecar to post and leave
    assert sidecar.poll() is not None, "it left (its pipe closed, everything posted: below)"
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    got = ttftscope_sql(col.store, "SELECT SpanName AS n, count() AS c FROM otel_traces "
                                   "WHERE ServiceName = 'signalled' GROUP BY n ORDER BY n")
    assert [(r["n"], int(r["c"])) for r in got] == [("at-exit", 50), ("early", 1)]


@pytest.mark.parametrize("n", [0, 63, 64, 150, 4096, 5000])
@pytest.mark.parametrize("big", [False, True])
def test_prefix_hashes_handed_over_hash_as_they_would_here(n, big):
    """A prompt's prefix hashes computed after the trip through the pickle the sidecar reads
    are the ones computed in the serving process: prompts shorter than a block, on and off the
    block boundary, past the 64-block cap, token ids past 2**31, and hashes already computed."""
    import pickle
    import random

    rng = random.Random(n)
    toks = TokenList(rng.randrange(2**40 if big else 150_000) for _ in range(n))
    here = PrefixHashes(toks)
    there = pickle.loads(bytes(handoff.dump_frame(PrefixHashes(toks))[4:]))
    assert there.hashes() == here.hashes() and str(there.chain) == str(here.chain)
    frozen = pickle.loads(bytes(handoff.dump_frame(PrefixHashes(toks).freeze())[4:]))
    assert frozen.hashes() == here.hashes()
    assert len(here.hashes()) == min(n // PREFIX_BLOCK, PREFIX_MAX_BLOCKS)


@pytest.mark.parametrize("prompt,hashed", [(127, 1), (128, 3), (300, 9), (9000, 80)])
def test_vllms_own_block_hashes_handed_over_stand_for_the_prompts_whole_blocks(prompt, hashed):
    """With prefix caching on, vLLM's block hashes (here 128-token blocks, perhaps running on into
    the output's) stand for the prompt: after the trip to the sidecar, as here, the prompt's
    whole blocks only, up to PREFIX_MAX_BLOCKS, each the hash's first 6 bytes; none for a prompt
    shorter than a block; no token id travels."""
    import hashlib
    import pickle

    vllms = [hashlib.sha256(str(i).encode()).digest() for i in range(hashed)]
    here = PrefixHashes.of_engine(vllms, prompt, 128)
    want = [h[:6].hex() for h in vllms[:min(prompt // 128, PREFIX_MAX_BLOCKS)]]
    if not want:
        assert here is None
        return
    frame = bytes(handoff.dump_frame(here)[4:])
    there = pickle.loads(frame)
    assert there.hashes() == here.hashes() == want and there.block == 128
    assert str(there) == want[0] and str(there.chain) == ",".join(want)
    assert len(frame) < 40 * len(want) + 200, "the hashes travel, not the prompt"


def test_a_sidecar_still_posting_at_exit_finishes_on_its_own(monkeypatch):
    """The serving process waits only so long at exit (vLLM kills a child's whole tree when it
    lingers); a sidecar whose collector answers slowly is left to finish, and it does."""
    from support.http_stub import PostSink

    with PostSink(delay_s=1.5) as sink:
        monkeypatch.setattr(handoff, "EXIT_WAIT_S", 0.2)
        proc, tracer, ours, vllms = _pipeline(sink.url, "slow", True)
        ours.add("at-exit", T0, T0 + 1, {"marker": "left-to-finish"})
        proc.force_flush()  # the sidecar starts and takes the span
        sidecar = proc.link.proc
        proc.shutdown()
        assert sidecar.poll() is None and not sink.seen, "the serving process left before the slow post came back"
        assert sidecar.wait(30) == 0
        assert len(sink.seen) == 1 and b"left-to-finish" in sink.seen[0][1]


def test_the_sidecars_processor_flushes_its_raw_bodies_too(collector_factory):
    """The sidecar's own processor (serialized bodies handed over whole, besides records) flushes
    through the same one-drain-at-a-time path as the plugin's: its raw bodies are posted before
    the flush returns. (Its drain override took no timeout and would have failed a flush.)"""
    from ttftscope.collector.span_wire import request_entry

    col = collector_factory().start()
    proc = handoff._SidecarProcessor(handoff._NoExporter(), interval_s=60,
                                     poster=OtlpHttpPoster(col.url + "/v1/traces", timeout=5))
    src = DeferredSpans(None, Resource.create({"service.name": "raw-bodies"}))
    src.add("raw", T0, T0 + 1, {"i": 1})
    proc.raw.append(request_entry(src.encode(src.take(1))))
    assert proc.force_flush() and not proc.raw and proc.failed == 0
    proc.shutdown()
    col.wait_quiet(quiet_s=1.0)
    assert col.terminate() == 0
    got = ttftscope_sql(col.store, "SELECT count() AS c FROM otel_traces WHERE ServiceName = 'raw-bodies'")
    assert int(got[0]["c"]) == 1


def test_the_sidecar_encodes_without_giving_its_gil_away(monkeypatch):
    """A serving process's export thread sleeps now and then while it encodes, so that vLLM's
    threads get the GIL; the sidecar serves nothing, and its encoder must not pay those sleeps
    (wall time, and a cold wake-up after each). The same records through both processors: the
    in-process one sleeps (the check can fail), the sidecar's never."""
    from ttftscope.collector import otel_setup

    class Discard:
        def export(self, body) -> bool:
            return True

    me, sleeps, sleep = threading.get_ident(), [], otel_setup.time.sleep

    def counted(s: float) -> None:  # this thread's (the drain's) sleeps; other threads sleep as before
        if threading.get_ident() == me:
            sleeps.append(s)
        else:
            sleep(s)

    monkeypatch.setattr(otel_setup.time, "sleep", counted)
    monkeypatch.setattr(otel_setup, "YIELD_S", 1e-9)  # a yield's turn comes at every span
    counts = {}
    for name, proc in (("in-process", BoundedBatchSpanProcessor(None, interval_s=60, poster=Discard())),
                       ("sidecar", handoff._SidecarProcessor(handoff._NoExporter(), interval_s=60,
                                                             poster=Discard()))):
        src = DeferredSpans(None, Resource.create({"service.name": "s"}))
        proc.add_source(src)
        for k in range(50):
            src.add("x", T0 + k, T0 + k + 1, {"k": k}, {"traceparent": TP})
        sleeps.clear()
        proc._drain(True, 5.0)
        assert not len(src) and proc.exported == 50
        counts[name] = len(sleeps)
        proc.shutdown()
    assert counts["in-process"] > 0 and counts["sidecar"] == 0, counts


_SERVING = """
import sys, time
sys.path.insert(0, {tests!r})
from test_export_sidecar import T0, _pipeline
proc, tracer, ours, vllms = _pipeline({url!r}, "tree-killed", True)
ours.add("first", T0, T0 + 1, {{}})
assert proc.force_flush()  # the sidecar posts it; the collector takes a second to answer
time.sleep(0.3)
for i in range(20):
    ours.add("handed-over", T0 + i, T0 + i + 1, {{"i": i}})
assert proc.force_flush()  # in the sidecar's hands, behind the post in flight
print(proc.link.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_sidecar_outlives_its_serving_process_tree_killed_as_vllm_kills_it():
    """At a shutdown that aborts requests (``--shutdown-timeout 0``, vLLM's default) vLLM
    SIGKILLs its engine core's whole process tree at once (``kill_process_tree``), and Ctrl-C
    signals the whole process group: the sidecar is not in the tree (a child of init) and
    ignores the group's signal, so what it was handed is still posted. Before, it was the serving
    process's child and died with it, its batch with it."""
    import psutil
    from vllm.utils.system_utils import kill_process_tree

    from support.http_stub import PostSink

    with PostSink(delay_s=1.0) as sink:
        serving = subprocess.Popen([sys.executable, "-c", _SERVING.format(tests=str(ROOT / "tests"), url=sink.url)],
                                   stdout=subprocess.PIPE, text=True, cwd=ROOT, start_new_session=True)
        try:
            pid = int(serving.stdout.readline())
            sidecar = psutil.Process(pid)
            assert pid not in {c.pid for c in psutil.Process(serving.pid).children(recursive=True)}
            # in vLLM's session still: its autogroup (Linux), where its nice 10 yields to vLLM's threads
            assert os.getsid(pid) == os.getsid(serving.pid)
            if os.path.exists(f"/proc/{pid}/autogroup"):
                with open(f"/proc/{pid}/autogroup") as a, open(f"/proc/{serving.pid}/autogroup") as b:
                    assert a.read().split()[0] == b.read().split()[0]
            os.killpg(serving.pid, signal.SIGINT)  # the terminal's Ctrl-C (the group)...
            kill_process_tree(serving.pid)  # ...and vLLM's force-kill of the tree
            assert serving.wait(10) == -signal.SIGKILL
            sidecar.wait(30)  # it posted what it held, then left (its pipe closed)
        finally:
            if serving.poll() is None:
                serving.kill()
        bodies = [body for _, body in sink.seen]
        assert len(bodies) == 2 and bodies[1].count(b"handed-over") == 20, [b.count(b"handed-over") for b in bodies]


def _arrived(sink, marker: bytes) -> int:
    return sum(body.count(marker) for _, body in list(sink.seen))


@pytest.mark.parametrize("sidecar", [False, True], ids=["in-process", "sidecar"])
def test_spans_exported_while_the_collector_is_down_arrive_once_it_is_back(sidecar):
    """A collector restarting (or not up yet) refuses connections: nothing of a post reached it,
    so its spans are kept (bounded by the queue) and sent again, once each, when it is back. They
    were counted failed and let go: a batch lost every interval the collector was down."""
    from support.http_stub import PostSink
    from ttftscope.servers import free_port

    port = free_port()
    proc, tracer, ours, vllms = _pipeline(f"http://127.0.0.1:{port}", "restart", sidecar, interval_s=0.2, max_batch=4)
    try:
        for i in range(10):
            ours.add("while-down", T0 + i, T0 + i + 1, {"i": i})
        time.sleep(1.5)  # several intervals' tries, every connection refused
        with PostSink(port=port) as sink:
            deadline = time.monotonic() + 30
            while _arrived(sink, b"while-down") < 10 and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.5)  # (nothing more comes: once each)
            assert _arrived(sink, b"while-down") == 10
    finally:
        proc.shutdown()


def test_a_sidecar_at_exit_keeps_trying_a_collector_that_is_down_for_a_while(monkeypatch):
    """The serving process leaves (vLLM stopped) while the collector is down: its sidecar, outside
    vLLM's processes, keeps trying (``linger_s``) and posts once the collector is back. It left at
    once, its spans lost, when the collector was not there at that moment (a restart of both)."""
    from support.http_stub import PostSink
    from ttftscope.servers import free_port

    monkeypatch.setattr(handoff, "EXIT_WAIT_S", 0.2)
    port = free_port()
    proc, tracer, ours, vllms = _pipeline(f"http://127.0.0.1:{port}", "exit-down", True, interval_s=0.2)
    ours.add("left-while-down", T0, T0 + 1, {"marker": 1})
    proc.force_flush()  # the sidecar starts and takes the span
    sidecar = proc.link.proc
    proc.shutdown()
    time.sleep(1.0)
    assert sidecar.poll() is None, "the sidecar is still trying"
    with PostSink(port=port) as sink:
        assert sidecar.wait(30) == 0
        assert _arrived(sink, b"left-while-down") == 1


def test_a_serving_process_leaving_while_the_collector_is_down_does_not_wait_for_its_sidecar(caplog):
    """At its default (``EXIT_WAIT_S``, 4 s) a serving process leaving while the collector was down
    waited all of it for its sidecar to post (seen: vLLM's API server stopped 4 s later with the
    collector down): waiting cannot help then, and the sidecar goes on trying on its own. It
    leaves without waiting, says so, and nothing is lost: the spans arrive when the collector is
    back. The witness of "without waiting" is the process's own account, not a stopwatch."""
    import logging

    from support.http_stub import PostSink
    from ttftscope.servers import free_port

    port = free_port()
    proc, tracer, ours, vllms = _pipeline(f"http://127.0.0.1:{port}", "exit-no-wait", True, interval_s=0.2)
    ours.add("left-at-once", T0, T0 + 1, {"marker": 1})
    proc.force_flush()  # the sidecar starts and takes the span
    sidecar = proc.link.proc
    with caplog.at_level(logging.INFO, logger="vllm.ttftscope"):
        proc.shutdown()
    said = [r.getMessage() for r in caplog.records]
    assert any("not reachable; leaving without waiting" in m and str(sidecar.pid) in m for m in said), said
    assert not any("still posting" in m for m in said), "it did not wait for the sidecar and give up"
    assert sidecar.poll() is None, "the sidecar goes on trying"
    with PostSink(port=port) as sink:
        assert sidecar.wait(30) == 0
        assert _arrived(sink, b"left-at-once") == 1


def test_a_sidecar_at_exit_gives_up_on_a_collector_that_stays_down(capfd):
    """... for ``linger_s`` at most: a collector that never comes back costs the spans, not a
    process left behind, and the sidecar says how many and after how long."""
    from ttftscope.servers import free_port

    port = free_port()
    proc, tracer, ours, vllms = _pipeline(f"http://127.0.0.1:{port}", "never", True, interval_s=0.2, linger_s=1.0)
    ours.add("never-posted", T0, T0 + 1, {"marker": 1})
    proc.force_flush()
    sidecar = proc.link.proc
    proc.shutdown()
    assert sidecar.wait(30) == 0
    assert "1 never taken by the collector in 1 s" in capfd.readouterr().err  # its setting, not the default 30


def test_the_step_flush_thread_exports_on_the_interval_only_through_a_sidecar(monkeypatch):
    """The engine core's step-flush thread (every ``FOLD_EVERY_S``) exports the spans itself on
    the export interval while they go to an export sidecar, so no more posts are made than the
    export thread made; once the sidecar is broken (a post to the collector could block it) the
    export thread takes its interval back. Every span arrives once."""
    import dataclasses

    from ttftscope.collector.vllm_plugin.runtime import RT

    from support.http_stub import PostSink

    with PostSink() as sink:
        proc, tracer, ours, vllms = _pipeline(sink.url, "flush-driven", True, interval_s=2.0)
        monkeypatch.setattr(RT, "processor", proc)
        monkeypatch.setattr(RT, "config", dataclasses.replace(RT.config, steps_in_sidecar=True))
        try:
            ours.add("tick-span", T0, T0 + 1, {"i": 0})
            assert SH.export_on_this_thread(proc, 1) == 0.0, "every second tick: the 2-s interval"
            assert proc.driven and proc.posts == 0
            assert SH.export_on_this_thread(proc, 2) > 0 and (proc.posts, proc.exported) == (1, 1)
            proc.link.broken = True
            ours.add("tick-span", T0 + 1, T0 + 2, {"i": 1})
            assert SH.export_on_this_thread(proc, 4) == 0.0 and not proc.driven, "the export thread's own again"
            deadline = time.monotonic() + 20
            while proc.exported < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.exported == 2
        finally:
            proc.link.broken = False
            proc.shutdown()
        deadline = time.monotonic() + 20
        while sum(body.count(b"tick-span") for _, body in list(sink.seen)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(body.count(b"tick-span") for _, body in list(sink.seen)) == 2
