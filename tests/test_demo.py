"""The main job end to end: `ttftscope demo --quick`, `ttftscope run` against a server, `sweep`."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from datetime import datetime

import psutil
import pytest
import requests
from conftest import PY, ROOT, CollectorProc, VllmServer, free_port, still_running, ttftscope_sql
from ttftscope.schemas.vocabulary import Attr, SpanName


@pytest.mark.slow
def test_demo_quick_collects_every_phase_names_queueing_serves_the_ui_and_cleans_up(tmp_path):
    store, port = str(tmp_path / "store"), free_port()
    t0 = time.time()
    proc = subprocess.Popen([PY, "-m", "ttftscope", "demo", "--quick", "--store", store, "--workdir", str(tmp_path / "w"),
                             "--ui-port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "web UI: http://" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(900), "".join(lines[-60:])
        assert requests.get(f"http://127.0.0.1:{port}/_stcore/health", timeout=10).status_code == 200
        kids = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert kids, "the UI runs as a child"
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        rc = proc.wait(120)
        assert rc in (0, 130), f"exit status {rc}:\n" + "".join(lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    alive = still_running(kids)
    assert not alive, f"children left behind: {alive}\n" + "".join(lines[-40:])
    out = "".join(lines)
    for step in ("[1/6]", "[2/6]", "[3/6]", "[4/6", "[5/6]", "[6/6]"):
        assert step in out, "progress is shown throughout"
    burst = next((line for line in lines if line.startswith("burst")), None)
    assert burst is not None and "queue" in burst.lower(), f"the burst's main cause is queueing: {burst}\n{out}"
    # ... held by the steps' token budget (100 prompts at once, seats for all): the budget vLLM says it was started with
    budgets = {int(m) for log in (tmp_path / "w").rglob("vllm-*.log")
               for m in re.findall(r"non-default args: .*'max_num_batched_tokens': (\d+)", log.read_text(errors="replace"))}
    assert len(budgets) == 1 and f"token budget ({budgets.pop():,} tokens" in burst, (budgets, burst)
    names = {r["SpanName"] for r in ttftscope_sql(store, "SELECT DISTINCT SpanName FROM otel_traces")}
    for span in ("llm_request", "ttftscope.tokenize", "ttftscope.queue", "ttftscope.prefill", "ttftscope.deliver",
                 "ttftscope.allreduce", "ttftscope.process", "Load model"):
        assert span in names, f"real vLLM traces of every phase: {span} missing"
    runs = ttftscope_sql(store, "SELECT DISTINCT ResourceAttributes['ttftscope.run'] AS r FROM otel_traces WHERE r != ''")
    assert len(runs) == 1 and runs[0]["r"].startswith("demo-")
    # the whole run's report: from when the demo started (not minutes before), with every vLLM process's cold start,
    # its phases in the order they started (the plugin's "process start and imports" first)
    head = re.search(r"ttftscope report — (\S+) \.\. (\S+)", out)
    assert head and t0 - 1 <= datetime.fromisoformat(head.group(1)).timestamp() <= t0 + 60, (head and head.group(0), t0)
    cold = [line for line in out.split("\nCold start\n")[-1].split("\n\n")[0].splitlines() if line.startswith("- ")]
    assert sum(line.startswith("- engine_core") for line in cold) >= 1 and sum(line.startswith("- worker") for line in cold) >= 1, cold
    for line in cold:
        assert line.split("; ", 1)[1].startswith("process start and imports"), line
        # vLLM nests its start-up spans ("EngineCoreProc init" holds "Executor init" and "Prepare model", a
        # "Worker init" another): a phase's parts in brackets, so the phases outside them and the idle share
        # make the cold start (listed flat, they came to 34 s of a 20-s start)
        head_, phases_ = line.split("; ", 1)
        while (flat := re.sub(r" \[[^\[\]]*\]", "", phases_)) != phases_:
            phases_ = flat
        top = [float(x) for x in re.findall(r" (\d+\.\d) s(?:,|$)", phases_)]
        total, idle = (float(x) for x in re.search(r": (\d+\.\d) s \(target .*idle (\d+)%", head_).groups())
        assert abs(sum(top) + total * idle / 100 - total) <= 0.05 * total + 0.1 * len(top), line


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "sigint-came-in-ignored", "sigterm-twice"])
def test_a_signal_stops_the_demo_and_every_child_it_started(tmp_path, how):
    """``kill`` (a CI job's timeout, systemd) while vLLM is starting: the demo stops its collector
    and its vLLM server (each in a session of its own) as Ctrl-C does; before, SIGTERM ended the
    demo alone and left them running, and a Ctrl-C during vLLM's start-up left the server. And
    ``kill -INT`` where SIGINT came in ignored (a job a shell without job control started in the
    background: Python keeps it ignored), which did nothing before. And a second signal in the
    middle of the clean-up, which stopped it there."""
    sig = signal.SIGTERM if how == "sigterm" else signal.SIGINT
    proc = subprocess.Popen([PY, "-m", "ttftscope", "demo", "--quick", "--no-tp2", "--no-ui", "--store", str(tmp_path / "store"),
                             "--workdir", str(tmp_path / "w")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=None if how == "sigterm" else _ignore_sigint)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    kids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            for c in psutil.Process(proc.pid).children(recursive=True):
                try:
                    kids.setdefault(c.pid, " ".join(c.cmdline()))
                except psutil.NoSuchProcess:
                    pass
            if any("vllm" in cmd for cmd in kids.values()) and any(" collect " in cmd for cmd in kids.values()):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "".join(lines)
        assert any("vllm" in cmd for cmd in kids.values()), f"vLLM is starting: {kids}"
        time.sleep(2)
        for c in psutil.Process(proc.pid).children(recursive=True):
            kids.setdefault(c.pid, "")
        proc.send_signal(sig)
        if how == "sigterm-twice":
            time.sleep(0.3)
            proc.send_signal(sig)
        assert proc.wait(120) == 130, "".join(lines)
        time.sleep(1)
        alive = [(pid, kids[pid]) for pid in still_running(kids)]
        assert not alive, f"children left behind: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in kids:  # whatever is left, with the sessions it started (vLLM's engine core, workers)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One collector and vLLM server (vLLM's defaults) for the ``ttftscope run`` tests; the
    test that kills the server mid-profile is the last to use it."""
    tmp_path = tmp_path_factory.mktemp("served")
    col = CollectorProc(str(tmp_path / "store"), tmp_path / "spool").start()
    srv = VllmServer(tmp_path, col.url + "/v1/traces", run="run-test").start()
    yield col, srv
    srv.stop()
    if col.proc and col.proc.poll() is None:
        col.terminate()


@pytest.mark.slow
def test_run_against_a_running_server_is_a_ci_gate(served, tmp_path):
    col, srv = served
    prof = tmp_path / "p.yaml"
    prof.write_text("name: gate\nrequest_rate: 8\nduration_s: 3\ninput_len: 128\noutput_len: 8\n")
    ok = subprocess.run([PY, "-m", "ttftscope", "run", "--store", col.store, "--server", srv.url, "--profile", str(prof),
                         "--slo", "p50=5000,p95=10000,p99=20000", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert ok.returncode == 0, ok.stderr[-2000:]
    res = json.loads(ok.stdout)
    assert res["benchmark"]["completed"] == 24 and res["report"]["requests"] >= 24
    gate = subprocess.run([PY, "-m", "ttftscope", "run", "--store", col.store, "--server", srv.url, "--profile", str(prof),
                           "--slo", "p50=0.01"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert gate.returncode == 1, "an SLO violation fails the gate"
    assert "VIOLATED" in gate.stdout
    n = ttftscope_sql(col.store, "SELECT count() AS n FROM otel_traces WHERE SpanName = 'ttftscope.loadtest'")[0]["n"]
    assert int(n) == 2, "each run's benchmark numbers are stored next to the traces"
    bad = tmp_path / "bad.yaml"
    bad.write_text("request_rate: fast\n")
    r = subprocess.run([PY, "-m", "ttftscope", "run", "--store", col.store, "--server", srv.url, "--profile", str(bad)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_server_killed_mid_profile_is_reported_and_collected_data_kept(served, tmp_path):
    col, srv = served
    since = time.time_ns()  # the server is shared: this profile's requests are the ones after this
    prof = tmp_path / "p.yaml"
    prof.write_text("name: long\nrequest_rate: 4\nnum_prompts: 200\ninput_len: 128\noutput_len: 8\n")
    p = subprocess.Popen([PY, "-m", "ttftscope", "run", "--store", col.store, "--server", srv.url, "--profile", str(prof)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # until requests of the profile have reached the store, then kill
    while time.monotonic() < deadline and p.poll() is None:
        if _requests_since(col.store, since):
            break
        time.sleep(1)
    os.killpg(srv.proc.pid, signal.SIGKILL)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 3, (out[-1500:], err[-1500:])
    assert "exited during profile" in err and "kept" in err
    assert _requests_since(col.store, since) > 0, "what was collected before the kill is in the store"


def _requests_since(store: str, since_ns: int) -> int:
    """vLLM's ``llm_request`` spans in ``store`` that started at or after ``since_ns``."""
    return int(ttftscope_sql(store, "SELECT count() AS n FROM otel_traces WHERE SpanName = 'llm_request' "
                                    "AND Timestamp >= fromUnixTimestamp64Nano({s:Int64})", params={"s": since_ns})[0]["n"])


@pytest.mark.slow
def test_sweep_over_two_settings_recommends_one(tmp_path):
    store = str(tmp_path / "store")
    prof = tmp_path / "p.yaml"
    prof.write_text("name: sweep\nrequest_rate: inf\nnum_prompts: 40\ninput_len: 256\noutput_len: 4\n")
    r = subprocess.run([PY, "-m", "ttftscope", "sweep", "--store", store, "--workdir", str(tmp_path / "w"), "--profile", str(prof),
                        "--grid", "max_num_batched_tokens=64,512"], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("{'max_num_batched_tokens'")]
    assert len(rows) == 2
    for row in rows:  # TTFT p50 and p99 of each setting, measured from the store
        m = re.search(r"\}\s+([0-9.]+)m\s+([0-9.]+)m\s+([0-9.]+)", row)
        assert m and 0 < float(m.group(1)) <= float(m.group(2)) and float(m.group(3)) > 0, row
    assert "recommended: {'max_num_batched_tokens'" in r.stdout and "lowest TTFT p99" in r.stdout
    runs = ttftscope_sql(store, "SELECT uniqExact(ResourceAttributes['ttftscope.run']) AS n FROM otel_traces "
                               "WHERE SpanName = 'llm_request'")
    assert int(runs[0]["n"]) == 2, "each setting's traces are stored under their own run label"


@pytest.mark.slow
def test_run_with_priority_classes(tmp_path):
    col = CollectorProc(str(tmp_path / "store"), tmp_path / "spool").start()
    srv = VllmServer(tmp_path, col.url + "/v1/traces", run="prio", extra=["--scheduling-policy", "priority"]).start()
    try:
        prof = tmp_path / "p.yaml"
        prof.write_text("name: mixed\nrequest_rate: 12\nnum_prompts: 40\ninput_len: 128\noutput_len: 4\n"
                        "priority_classes: {0: 0.25, 1: 0.75}\n")
        r = subprocess.run([PY, "-m", "ttftscope", "run", "--store", col.store, "--server", srv.url, "--profile", str(prof),
                            "--slo", "p50=5000,p95=10000,p99=20000", "--json"], capture_output=True, text=True, cwd=ROOT,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads(r.stdout)
        assert set(res["benchmark"]["classes"]) == {"0", "1"}
        assert res["benchmark"]["classes"]["0"]["completed"] == 10 and res["benchmark"]["classes"]["1"]["completed"] == 30
        assert {"priority=0", "priority=1"} <= set(res["report"]["slo"]["classes"]), "SLO attainment per priority class"
        assert "queue_p99" in res["report"]["slo"]["classes"]["priority=0"]
        # the engine's priority (vLLM's Request.priority, on the queue span) is the one the client
        # sent, request by request (negative too: lower is sooner in vLLM)
        sent = {}
        for p in (3, -2, 0):
            r = requests.post(srv.url + "/v1/completions", json={"model": srv.model, "prompt": f"priority {p}",
                                                                 "max_tokens": 2, "priority": p}, timeout=120)
            r.raise_for_status()
            sent[r.json()["id"]] = str(p)
        col.wait_quiet()
    finally:
        srv.stop()
        col.terminate()
    rows = ttftscope_sql(col.store, f"""
        SELECT SpanAttributes['{Attr.REQUEST_ID}'] AS rid, SpanAttributes['{Attr.PRIORITY}'] AS p
        FROM otel_traces WHERE SpanName = '{SpanName.QUEUE}'""")
    got = {rid: [r["p"] for r in rows if r["rid"].startswith(rid) or rid.startswith(r["rid"])] for rid in sent}
    assert got == {rid: [p] for rid, p in sent.items()}, got


def test_the_demo_notes_where_its_client_reads_above_the_report():
    from ttftscope.demo import client_note

    # (profile, report p50 ms, client p50 ms): a burst's client well above, a quiet profile's close
    note = client_note([("steady", 23.2, 22.9), ("burst", 584.5, 674.2), ("shared-prefix", 14.3, 14.0)])
    assert note is not None and "burst +89.7 ms" in note and "steady" not in note
    assert client_note([("steady", 23.2, 22.9), ("long-prompts", 73.6, 75.3)]) is None
    # a client below the report is not this note's business (the report is never longer: truth tests)
    assert client_note([("burst", 584.5, 500.0)]) is None
