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
print("ready", flush=True)
time.sleep(600)
"""


def _holder(url: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _HOLDER.format(tests=str(ROOT / "tests"), url=url)],
                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_process_asked_hands_over_what_it_holds_before_it_is_killed():
    with PostSink() as sink:
        holder = _holder(sink.url)
        try:
            t0 = time.monotonic()
            assert handover.ask([holder.pid], wait_s=10) == (1, 1)
            waited = time.monotonic() - t0
            holder.kill()  # as vLLM's force-kill right after
            holder.wait(10)
            deadline = time.monotonic() + 30
            while not sink.seen and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            holder.kill()
        body = b"".join(b for _, b in sink.seen)
        assert body.count(b"held") == 10 and body.count(b"open-run") == 1, "what it held and its exit hook's record"
        assert waited < 10, "answered, not timed out"


def test_a_process_that_does_not_listen_is_skipped_and_one_that_does_not_answer_costs_the_wait():
    not_plugin = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with PostSink() as sink:
        holder = _holder(sink.url)
        os.kill(holder.pid, signal.SIGSTOP)  # listening, never answering
        try:
            t0 = time.monotonic()
            assert handover.ask([not_plugin.pid, holder.pid, 2**22 + 7], wait_s=0.5) == (1, 0)
            assert time.monotonic() - t0 >= 0.5
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
