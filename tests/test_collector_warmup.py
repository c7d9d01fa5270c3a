"""A collector's first seconds: its compiled passes are compiled (or loaded from numba's
cache) on a thread of their own, and nothing else waits for them. Before this was so, the
decode pass and the phase metrics' lookup pass said "ready" *before* compiling, so the
flusher's first flush after that waited for numba's compiler lock — seconds on a fresh
clone's cold cache, longer on a busy machine: the store stood still while requests were
acknowledged (a clean clone's `test_concurrent_reads_while_writing` saw the same 700 spans
in five reads in a row).

Each case runs in a fresh process (nothing compiled there yet), holds numba's own compiler
lock so that the warm-up is stuck in it for as long as the test wants, and then flushes:
the flush must finish — by the paths that need no compiling — while the warm-up still waits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ttftscope.collector import otlp_scan

pytestmark = pytest.mark.skipif(not otlp_scan.available(), reason="numba is not installed")

ROOT = Path(__file__).resolve().parent.parent

#: what both scripts start with: a flusher's pipeline over a fresh store (every segment due at
#: once), and the spans a store holds
PRELUDE = textwrap.dedent("""
    import json, sys, threading, time
    from pathlib import Path
    from ttftscope.collector import otlp_compiled, otlp_scan, phase_metrics, service
    from ttftscope.collector.metrics import CollectorMetrics
    from ttftscope.collector.pipeline import Pipeline
    from ttftscope.collector.spool import Spool
    from ttftscope.schemas.store import open_store

    def pipeline(tmp: Path) -> tuple[Pipeline, str]:
        store = str(tmp / "store")
        open_store(store).close()
        return Pipeline(lambda: open_store(store), Spool(tmp / "spool", segment_age_s=0.0), CollectorMetrics()), store

    def stored(store: str) -> int:
        return int(open_store(store).query("SELECT count() AS n FROM otel_traces")["n"][0])
""")


def _run(script: str, *args: str) -> dict:
    """The prelude and ``script`` in a fresh process (nothing compiled there yet): its last line, as JSON."""
    r = subprocess.run([sys.executable, "-c", PRELUDE + script, *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


SCRIPT = textwrap.dedent("""
    from numba.core.compiler_lock import global_compiler_lock
    from support.otlp import numbered_batch

    tmp, stuck_in = Path(sys.argv[1]), sys.argv[2]
    assert otlp_scan.warm_up()  # the receiver's pass (it flips its flag only once compiled)
    if stuck_in == "phase metrics":
        assert otlp_compiled.warm_up()
    pipe, store = pipeline(tmp)
    pipe.submit_otlp(numbered_batch(0, 50), 50)

    global_compiler_lock.acquire()  # the warm-up below compiles: it waits here until released
    warm = threading.Thread(target=service._warm_up, daemon=True)
    warm.start()

    def waiting_for_the_compiler() -> bool:
        f = sys._current_frames().get(warm.ident)
        while f is not None:
            if f.f_code.co_filename.endswith("compiler_lock.py") and f.f_code.co_name == "acquire":
                return True
            f = f.f_back
        return False

    while not waiting_for_the_compiler():
        assert warm.is_alive(), "the warm-up finished without compiling anything"
        time.sleep(0.01)
    out = {}
    flush = threading.Thread(target=lambda: out.update(written=pipe.flush_once()), daemon=True)
    flush.start()
    flush.join(60)  # a deadlock guard, not a speed limit: a flush that waits waits for the lock
    out["flush_finished_while_the_warm_up_waited"] = not flush.is_alive() and waiting_for_the_compiler()
    out["ready_flags"] = [otlp_compiled.ready(), phase_metrics._compiled]
    global_compiler_lock.release()
    flush.join(60)
    warm.join(120)
    out["ready_after"] = [otlp_compiled.ready(), phase_metrics._compiled]
    out["stored"] = stored(store)
    print(json.dumps(out))
""")


@pytest.mark.parametrize("stuck_in", ["decode", "phase metrics"])
def test_a_flush_never_waits_for_the_compiler(tmp_path, stuck_in):
    out = _run(SCRIPT, str(tmp_path), stuck_in)
    assert out["flush_finished_while_the_warm_up_waited"], out
    assert out["written"] == 50 and out["stored"] == 50, out
    assert out["ready_flags"] == [stuck_in == "phase metrics", False], "nothing says ready before it is compiled"
    assert out["ready_after"] == [True, True], "the warm-up finishes once the compiler is free"


SIGNATURES = textwrap.dedent("""
    import numba
    import numpy as np
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from ttftscope.collector import otlp_wire
    from ttftscope.collector.otlp import Limits, accept_protobuf
    from support.otlp import numbered_batch, otlp_request, plugin_like_request

    def signatures() -> dict:
        out = {}
        for mod in (otlp_compiled, otlp_scan, otlp_wire, phase_metrics):
            for name in dir(mod):
                d = getattr(mod, name)
                if isinstance(d, numba.core.registry.CPUDispatcher):
                    out[f"{mod.__name__.rsplit('.', 1)[-1]}.{name}"] = [str(s) for s in d.signatures]
        return out

    def bare() -> bytes:  # no resource attributes, no span attributes
        req = trace_service_pb2.ExportTraceServiceRequest()
        sp = req.resource_spans.add().scope_spans.add().spans.add()
        sp.trace_id, sp.span_id, sp.name = b"\\x05" * 16, b"\\x06" * 8, "bare"
        sp.start_time_unix_nano = sp.end_time_unix_nano = time.time_ns()
        return req.SerializeToString()

    def events_links() -> bytes:
        req = otlp_request(5, ids=lambda i: (7000 + i, 7000 + i))
        sp = req.resource_spans[0].scope_spans[0].spans[0]
        sp.events.add().name = "an event"
        sp.links.add().trace_id = b"\\x07" * 16
        return req.SerializeToString()

    tmp = Path(sys.argv[1])
    service._warm_up()
    assert otlp_compiled.ready() and phase_metrics._compiled, "the warm-up compiled both passes"
    before = signatures()
    pipe, store = pipeline(tmp)
    shapes = {
        "plugin-like": [plugin_like_request(40, seed=i) for i in range(50)],
        "many small, the worst row guess": [numbered_batch(i, 3) for i in range(300)],
        "one span": [numbered_batch(900, 1)],
        "bare, the worst row guess": [bare() for _ in range(40)],
        "with events and links": [events_links(), numbered_batch(901, 20)],
        "large": [plugin_like_request(2000, seed=7)],
    }
    flushed = []
    for what, bodies in shapes.items():
        if "worst" in what:
            otlp_compiled._density = np.zeros_like(otlp_compiled._density)
        for body in bodies:
            body, report, events_links = accept_protobuf(body, Limits())
            pipe.submit_otlp(body, report.accepted, events_links)
        # each on a thread of its own, as a new collector's flusher: its scratch tables start empty
        t = threading.Thread(target=lambda: flushed.append(pipe.flush_once()))
        t.start()
        t.join()
    written = sum(flushed)
    after = signatures()
    gained = {k: v[len(before.get(k, [])):] for k, v in after.items() if len(v) > len(before.get(k, []))}
    print(json.dumps({"gained": gained, "written": written, "scan_in_use": otlp_scan._ready and not otlp_scan._broken,
                      "stored": stored(store)}))
""")


def test_after_the_warm_up_no_flush_or_check_compiles(tmp_path):
    """Whatever a flush holds — many small bodies or one large one, bodies without any
    attribute, more rows than its tables' guess (the count-then-fill path) — it runs on what
    the warm-up compiled: a signature numba meets for the first time is compiled on the spot,
    on the flusher (on a fresh install's cold cache that stood the store still for 6-9 s, ~10 s
    after start, in a collector fed at full speed: bench/collector_first_seconds.py)."""
    out = _run(SIGNATURES, str(tmp_path))
    assert out["written"] == out["stored"] > 0, out
    assert out["gained"] == {}, f"compiled after the warm-up: {out['gained']}"
    assert out["scan_in_use"], "the arrival check (compiling disabled after its warm-up) met no type it lacked"
