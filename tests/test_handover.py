"""The shutdown hand-over (``vllm_plugin.handover``) between real processes: a process asked
hands over what it holds (its exit hooks' records included) before it is killed; one that does
not listen is skipped; one that does not answer costs the asker its wait, no more. The real
vLLM case (a server stopped right after its last request) is in tests/test_vllm_plugin.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT
from ttftscope.collector.vllm_plugin import handover

from support.http_stub import PostSink

_HOLDER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_export_sidecar import T0, _pipeline
from ttftscope.collector.vllm_plugin import handover, runtime
proc, tracer, ours, vllms = _pipeline({url!r}, "holder", True)  # exports every 60 s: it holds them
runtime.RT.processor = proc
runtime.at_exit(lambda: ours.add("open-run", T0, T0 + 1, {{}}))  # what an exit hook records (an open run of steps)
for i in range(10):
    ours.add("held", T0 + i, T0 + i + 1, {{"i": i}})
assert handover.listen()
if {term_noted}:  # as vLLM's engine core: SIGTERM noted by a handler (it then shuts down), not fatal at once
    import signal
    signal.signal(signal.SIGTERM, lambda *a: None)
print("ready", flush=True)
time.sleep(600)
"""


def _holder(url: str, term_noted: bool = False) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER.format(tests=str(ROOT / "tests"), url=url,
                                                               term_noted=term_noted)],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_process_asked_hands_over_what_it_holds_before_it_is_killed():
    with PostSink() as sink:
        holder = _holder(sink.url)
        try:
            assert handover.ask([holder.pid], wait_s=10) == (1, 1), "asked and answered"
            holder.kill()  # as vLLM's force-kill right after
            holder.wait(10)
            deadline = time.monotonic() + 30
            while not sink.seen and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            holder.kill()
        body = b"".join(b for _, b in sink.seen)
        assert body.count(b"held") == 10 and body.count(b"open-run") == 1, "what it held and its exit hook's record"


def test_a_process_that_does_not_listen_is_skipped_and_one_that_does_not_answer_costs_the_wait():
    not_plugin = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with PostSink() as sink:
        holder = _holder(sink.url)
        os.kill(holder.pid, signal.SIGSTOP)  # listening, never answering
        try:
            assert handover.ask([not_plugin.pid, holder.pid, 2**22 + 7], wait_s=0.5) == (1, 0)
        finally:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            not_plugin.kill()


@pytest.mark.skipif(os.getuid() != 0, reason="sends as another user: needs root to change its uid")
def test_a_request_from_another_user_is_ignored():
    """An abstract socket has no file permissions: any local user could send the request. The
    kernel's credentials on the datagram say who did; another user's is not answered or acted on."""
    asker = ("import os, sys; sys.path.insert(0, {root!r}); "
             "from ttftscope.collector.vllm_plugin import handover; os.setuid(65534); "
             "print(*handover.ask([{pid}], wait_s=1.0))")
    with PostSink() as sink:
        holder = _holder(sink.url)
        try:
            other = subprocess.run([sys.executable, "-c", asker.format(root=str(ROOT), pid=holder.pid)],
                                   capture_output=True, text=True, timeout=60)
            assert other.stdout.split() == ["1", "0"], other.stderr[-2000:]
            time.sleep(1.0)
            assert not sink.seen, "nothing handed over for another user's request"
            assert handover.ask([holder.pid], wait_s=10) == (1, 1), "its own user's is"
        finally:
            holder.kill()


@pytest.mark.parametrize("manager", ["engine-cores", "api-servers"])
def test_vllms_own_shutdown_with_the_adapter_asks_first_once_and_goes_on(monkeypatch, manager):
    """The adapters around vLLM's real process managers' ``shutdown`` (``CoreEngineProcManager``,
    the engine cores'; ``APIServerProcessManager``, a launcher's API servers'), vLLM's own code
    running (an abort: SIGTERM, then the process force-killed) on a real process standing in for
    one of its processes (vLLM's ``_SubprocessWrapper``: the rest of a manager is not needed to
    stop one). The spans it held arrive, asked for before vLLM's SIGTERM and its SIGKILL right
    after (the stand-in notes SIGTERM, as the engine core's handler does); vLLM calling shutdown
    again does not ask again; and the wrapped method's own errors reach vLLM's caller as they
    would without it."""
    import threading
    import weakref

    from ttftscope.collector.vllm_plugin.runtime import RT
    from ttftscope.schemas.vocabulary import ProcessRole
    from vllm.v1 import utils as v1_utils
    from vllm.v1.engine import utils
    from vllm.v1.utils import _SubprocessWrapper

    M, install, name = {"engine-cores": (utils.CoreEngineProcManager, handover._install_handover, "EngineCore_DP0"),
                        "api-servers": (v1_utils.APIServerProcessManager, handover._install_handover_api_servers,
                                        "ApiServer_0")}[manager]
    monkeypatch.setattr(M, "shutdown", M.shutdown)  # put back after the test
    monkeypatch.setattr(RT, "role", ProcessRole.API_SERVER.value)
    install()

    asked: list[list[int]] = []
    real_ask = handover.ask
    monkeypatch.setattr(handover, "ask", lambda pids, *a, **kw: (asked.append(list(pids)), real_ask(pids, *a, **kw))[1])
    with PostSink() as sink:
        holder = _holder(sink.url, term_noted=True)
        try:
            m = object.__new__(M)  # what vLLM's shutdown reads of a manager
            m.processes = [_SubprocessWrapper(holder, name)]
            m._request_shutdown_timeout = 0
            m.manager_stopped = threading.Event()
            m._listeners = []
            m._finalizer = weakref.finalize(m, lambda: None)
            m.shutdown(timeout=0)
            assert holder.wait(10) == -signal.SIGKILL, "vLLM force-killed it at once"
            m.shutdown(timeout=0)
            deadline = time.monotonic() + 30
            while not sink.seen and time.monotonic() < deadline:
                time.sleep(0.1)
            body = b"".join(b for _, b in sink.seen)
            assert body.count(b"held") == 10 and body.count(b"open-run") == 1
            assert asked == [[holder.pid]], "asked once, before vLLM's own shutdown"
            broken = object.__new__(M)  # no processes attribute, nothing vLLM's code needs: its error is its own
            with pytest.raises(AttributeError):
                broken.shutdown(timeout=0)
            m.processes.clear()  # (vLLM's wrapper let go now, not at interpreter exit)
        finally:
            holder.kill()
