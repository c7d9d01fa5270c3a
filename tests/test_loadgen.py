"""The load driver's child process (vLLM's benchmark, here stood in for by small scripts: the
real one runs against real vLLM in tests/test_demo.py): its result is read, and a server that
goes away mid-profile stops it at once instead of after the rest of its schedule."""

from __future__ import annotations

import pytest
from conftest import still_running

from ttftscope import loadgen
from ttftscope.loadgen import Profile, ServerGone, run_profile


def _child(monkeypatch, code: str) -> None:
    monkeypatch.setattr(loadgen, "_CHILD", code)
    monkeypatch.setattr(loadgen, "GONE_POLL_S", 0.05)


def test_the_benchmarks_result_is_read(monkeypatch):
    _child(monkeypatch, 'import json; print("noise"); print("@@RESULT@@" + json.dumps({"completed": 7}))')
    out = run_profile("http://127.0.0.1:9", "m", Profile(name="p"), alive=lambda: True)
    assert out["completed"] == 7 and out["profile"]["name"] == "p"


def test_a_failed_benchmark_says_why(monkeypatch):
    _child(monkeypatch, 'import sys; sys.stderr.write("no server here"); sys.exit(3)')
    with pytest.raises(RuntimeError, match="no server here"):
        run_profile("http://127.0.0.1:9", "m", Profile())


def test_a_server_gone_mid_profile_stops_the_benchmark(monkeypatch, tmp_path):
    pid_file = tmp_path / "pid"
    _child(monkeypatch, f'import os, time; open({str(pid_file)!r}, "w").write(str(os.getpid())); time.sleep(600)')
    checks = []

    def alive() -> bool:  # answers twice, then never again
        checks.append(1)
        return len(checks) <= 2

    with pytest.raises(ServerGone):
        run_profile("http://127.0.0.1:9", "m", Profile(name="p"), alive=alive)
    assert len(checks) == 2 + loadgen.GONE_CHECKS, "stopped after that many failed checks in a row, not before"
    pid = int(pid_file.read_text())
    assert not still_running([pid]), "the benchmark stopped"


def test_a_busy_moment_does_not_stop_it(monkeypatch):
    """Failed checks that are not ``GONE_CHECKS`` in a row do not stop a profile."""
    _child(monkeypatch, 'import json, time; time.sleep(1.0); print("@@RESULT@@" + json.dumps({"completed": 1}))')
    n = []

    def alive() -> bool:  # fails every other check
        n.append(1)
        return len(n) % 2 == 0

    assert run_profile("http://127.0.0.1:9", "m", Profile(), alive=alive)["completed"] == 1
    assert len(n) >= loadgen.GONE_CHECKS, "it was checked"
