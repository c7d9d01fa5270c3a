"""`ttftscope run` reports on every request it drove: it waits for the spans a collector stores in
flushes seconds apart (the CI gate once reported 20 of 24 requests: it stopped waiting when the
count had not moved for one second, shorter than the collector's flush interval)."""

from __future__ import annotations

import os
import threading
import time

from ttftscope.schemas.columns import spans_table
from ttftscope.schemas.store import open_store
from ttftscope.schemas.vocabulary import SpanName

from ttftscope.sweep import wait_for_request_spans

LO = 1_750_000_000_000_000_000


def _requests(n: int, first: int) -> list[dict]:
    return [{"Timestamp": LO + (first + i) * 10**8, "Duration": 10**7, "TraceId": os.urandom(16).hex(),
             "SpanId": os.urandom(8).hex(), "SpanName": SpanName.REQUEST, "ServiceName": "vllm"} for i in range(n)]


def _flush_in_batches(store, batches: list[int], every_s: float) -> threading.Thread:
    """Store request spans as a collector does: a part per flush, ``every_s`` apart."""
    def go() -> None:
        first = 0
        for k, n in enumerate(batches):
            if k:
                time.sleep(every_s)
            store.insert_spans(spans_table(_requests(n, first)), f"part-{k}")
            first += n
    t = threading.Thread(target=go)
    t.start()
    return t


def test_it_waits_through_flushes_seconds_apart_for_every_request(tmp_path):
    st = open_store(str(tmp_path / "s"))
    t = _flush_in_batches(st, [8, 8, 8], every_s=2.2)
    n = wait_for_request_spans(st, (LO, LO + 60 * 10**9), expect=24, quiet_s=5.0, timeout=60)
    t.join()
    assert n == 24


def test_when_some_never_arrive_it_stops_after_the_quiet_window_with_what_there_is(tmp_path, capsys):
    st = open_store(str(tmp_path / "s"))
    _flush_in_batches(st, [5, 4], every_s=0.5).join()
    n = wait_for_request_spans(st, (LO, LO + 60 * 10**9), expect=12, quiet_s=1.5, timeout=60)
    assert n == 9
    assert "9 of 12" in capsys.readouterr().err


def test_spans_outside_the_window_do_not_count(tmp_path):
    st = open_store(str(tmp_path / "s"))
    _flush_in_batches(st, [10], every_s=0).join()
    n = wait_for_request_spans(st, (LO + 5 * 10**8, LO + 60 * 10**9), expect=10, quiet_s=1.0, timeout=60)
    assert n == 5


def test_a_settle_time_that_is_not_seconds_is_refused_before_any_load(tmp_path):
    import subprocess

    from conftest import PY, ROOT

    for bad in ("0", "-3", "7200"):
        r = subprocess.run([PY, "-m", "ttftscope", "run", "--store", str(tmp_path / "s"), "--server",
                            "http://127.0.0.1:9", "--settle-s", bad], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 2 and "--settle-s" in r.stderr and "cannot reach" not in r.stderr, r.stderr
