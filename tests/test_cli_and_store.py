"""`ttftscope sql` and the store interface: formats, bound parameters, clear errors, retention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from conftest import PY, ROOT


def _fill(store_dir: str, n: int = 10, start_ns: int | None = None, token: str = "t"):
    from ttftscope.collector.otlp import SpanBatchBuilder
    from ttftscope.schemas.store import open_store

    st = open_store(store_dir)
    b = SpanBatchBuilder(now_ns=(start_ns or time.time_ns()) + 10**12)
    t0 = start_ns or time.time_ns()
    for i in range(n):
        b.add_span(start=t0 + i, end=t0 + i + 1000, trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", parent="",
                   trace_state="", name=f"name-{i % 3}", kind="Server", service="svc", resource={"service.name": "svc"},
                   scope_name="", scope_version="", attrs={"user": f"u{i}"}, status="Unset", status_msg="",
                   events=[], links=[])
    st.insert_spans(b.table(), token)
    return st


def _sql(*args, stdin: str | None = None):
    return subprocess.run([PY, "-m", "ttftscope", "sql", *args], capture_output=True, text=True, cwd=ROOT,
                          input=stdin, timeout=120)


def test_sql_formats(tmp_path):
    d = str(tmp_path / "s")
    _fill(d)
    q = "SELECT SpanName, count() AS n FROM otel_traces GROUP BY SpanName ORDER BY SpanName"
    table = _sql("--store", d, q)
    assert table.returncode == 0 and "name-0" in table.stdout and "┌" in table.stdout
    csv = _sql("--store", d, "--format", "csv", q)
    assert csv.stdout.splitlines() == ['"SpanName","n"', '"name-0",4', '"name-1",3', '"name-2",3']
    js = json.loads(_sql("--store", d, "--format", "json", q).stdout)
    assert [int(r["n"]) for r in js["data"]] == [4, 3, 3]
    tsv = _sql("--store", d, "--format", "tsv", q)
    assert tsv.stdout.splitlines()[0] == "SpanName\tn"
    piped = _sql("--store", d, "--format", "csv", "-", stdin="SELECT count() FROM otel_traces")
    assert piped.stdout.splitlines()[-1] == "10"


def test_store_from_environment_variable(tmp_path):
    d = str(tmp_path / "envstore")
    _fill(d, n=4)
    env = {**os.environ, "TTFTSCOPE_STORE": d}
    r = subprocess.run([PY, "-m", "ttftscope", "sql", "--format", "csv", "SELECT count() FROM otel_traces"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.stdout.splitlines()[-1] == "4"


@pytest.mark.parametrize("evil", ["u1' OR 1=1 --", "x'); DROP TABLE otel_traces; --", "\\' OR ''='"])
def test_parameters_are_bound_never_spliced(tmp_path, evil):
    d = str(tmp_path / "s")
    _fill(d)
    r = _sql("--store", d, "--format", "csv", "--param", f"u={evil}",
             "SELECT count() FROM otel_traces WHERE SpanAttributes['user'] = {u:String}")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "0"
    ok = _sql("--store", d, "--format", "csv", "--param", "u=u1",
              "SELECT count() FROM otel_traces WHERE SpanAttributes['user'] = {u:String}")
    assert ok.stdout.splitlines()[-1] == "1"


def test_clear_errors(tmp_path):
    missing = _sql("--store", str(tmp_path / "nope"), "SELECT 1")
    assert missing.returncode == 1 and "no ttftscope store" in missing.stderr
    assert not (tmp_path / "nope").exists(), "reading never creates a store"
    d = str(tmp_path / "s")
    _fill(d)
    bad = _sql("--store", d, "SELECT FROM WHERE")
    assert bad.returncode == 1 and "Syntax error" in bad.stderr and "Traceback" not in bad.stderr
    unknown = _sql("--store", d, "SELECT nope FROM otel_traces")
    assert unknown.returncode == 1 and "nope" in unknown.stderr
    scheme = _sql("--store", "postgres://x/y", "SELECT 1")
    assert scheme.returncode == 1 and "unknown store URL scheme" in scheme.stderr
    param = _sql("--store", d, "--param", "novalue", "SELECT 1")
    assert param.returncode == 2 and "NAME=VALUE" in param.stderr


def test_unreachable_clickhouse_is_reported_not_traced(tmp_path):
    from conftest import free_port

    r = _sql("--store", f"clickhouse://default:@127.0.0.1:{free_port()}/x", "SELECT 1")
    assert r.returncode == 1 and "unreachable" in r.stderr and "Traceback" not in r.stderr


def test_retention_drops_old_parts_only(tmp_path):
    d = str(tmp_path / "s")
    old = time.time_ns() - 10 * 86400 * 10**9
    st = _fill(d, n=5, start_ns=old, token="old")
    _fill(d, n=7, token="new")
    assert st.query("SELECT count() FROM otel_traces").item() == 12
    assert st.apply_retention(3) == 5
    assert st.query("SELECT count() FROM otel_traces").item() == 7


def test_batch_spanning_days_is_split_into_daily_parts(tmp_path):
    d = str(tmp_path / "s")
    from ttftscope.collector.otlp import decode  # noqa: F401 - import check
    day = 86400 * 10**9
    st = _fill(d, n=3, start_ns=(time.time_ns() // day) * day - 1, token="x")  # straddles midnight
    days = {p["day"] for p in st.manifest()["parts"]}
    assert len(days) == 2 and st.query("SELECT count() FROM otel_traces").item() == 3


def test_collect_rejects_a_busy_spool_and_bad_listen(tmp_path, collector_factory):
    c = collector_factory().start()
    r = subprocess.run([PY, "-m", "ttftscope", "collect", "--store", c.store, "--spool", str(c.spool),
                        "--listen", "127.0.0.1:0"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "in use by another collector" in r.stderr
    r = subprocess.run([PY, "-m", "ttftscope", "collect", "--store", c.store, "--spool", str(tmp_path / "sp2"),
                        "--listen", f"127.0.0.1:{c.port}"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "cannot listen" in r.stderr
    r = subprocess.run([PY, "-m", "ttftscope", "collect", "--listen", "nope:port"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "invalid HOST:PORT" in r.stderr
    assert c.terminate() == 0


def test_overlapping_parts_beyond_the_sorted_merge_size_are_streamed_whole(tmp_path, monkeypatch):
    """Parts whose time ranges overlap (a span that started before the last flush ended) were
    merged by reading them all at once, which at a sustained 100k spans/s held gigabytes. Past
    SORTED_MERGE_ROWS they are streamed: every span kept once, each row group still sorted."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from ttftscope.collector.otlp import decode
    from ttftscope.schemas.store import embedded, open_store

    from support.otlp import plugin_like_request

    monkeypatch.setattr(embedded, "SORTED_MERGE_ROWS", 50)
    st = open_store(str(tmp_path / "s"), merge_factor=4, row_group_size=16)
    t0 = 1_790_000_000 * 10**9
    ids = set()
    for b in range(4):  # spans 1 µs apart from t0 + b * 0.5 µs: every part overlaps the others
        table, _ = decode(plugin_like_request(30, seed=b, t0=t0 + b * 500), "protobuf")
        ids |= set(table.column("SpanId").to_pylist())
        assert st.insert_spans(table, f"tok-{b}")
    st.maintain()
    parts = st.manifest()["parts"]
    assert len(parts) == 1 and parts[0]["level"] == 1 and parts[0]["rows"] == 120
    f = pq.ParquetFile(tmp_path / "s" / "otel_traces" / f"{parts[0]['name']}.parquet")
    stored = f.read()
    assert sorted(stored.column("SpanId").to_pylist()) == sorted(ids), "every span once"
    assert parts[0]["min_ts"] == pc.min(stored.column("Timestamp").cast("int64")).as_py()
    assert parts[0]["max_ts"] == pc.max(stored.column("Timestamp").cast("int64")).as_py()
    for g in range(f.num_row_groups):
        ts = f.read_row_group(g).column("Timestamp").cast("int64").to_pylist()
        assert ts == sorted(ts), "each row group sorted within itself"
    ts = stored.column("Timestamp").cast("int64").to_pylist()
    assert ts != sorted(ts), "streamed, not read and sorted as a whole (the case this test is about)"


_POOL_PROBE = """
import sys
import ttftscope.cli as cli

def probe(a):
    import pyarrow as pa
    print(pa.default_memory_pool().backend_name)
    return 0

cli.cmd_collect = probe
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("env, want", [(None, "system"), ("mimalloc", "mimalloc")])
def test_collect_uses_the_c_allocator_for_arrow_unless_told(env, want):
    """``ttftscope collect`` picks Arrow's pool before anything imports pyarrow (the parser
    imports the analyzer): mimalloc's page churn was 14-16 % of a fleet-fed collector's CPU.
    A pool named in ``ARROW_DEFAULT_MEMORY_POOL`` stays."""
    envs = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if env:
        envs["ARROW_DEFAULT_MEMORY_POOL"] = env
    r = subprocess.run([PY, "-c", _POOL_PROBE, "-v", "collect", "--store", "unused"], capture_output=True, text=True,
                       cwd=ROOT, env=envs, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [want]
    default = subprocess.run([PY, "-c", "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"],
                             capture_output=True, text=True, env=envs, timeout=120).stdout.split()
    r = subprocess.run([PY, "-c", _POOL_PROBE.replace("cmd_collect", "cmd_sql"), "sql", "SELECT 1"],
                       capture_output=True, text=True, cwd=ROOT, env=envs, timeout=120)
    assert r.stdout.split() == default  # other commands keep pyarrow's own choice


def _legacy_window(st, n: int, spool: str = "a9ed" * 8) -> None:
    """The store's manifest as an older ttftscope left it after a flush of token "first" and ``n``
    flushes of one spool: its insert tokens one by one (``[token, time]``), a window of them ~600 KB."""
    import orjson

    with st._locked() as m:
        m.pop("token_runs", None)
        m["tokens"] = [["first", 1.6e9]] + [[f"{spool}-{i + 1}", 1.7e9 + 2 * i] for i in range(n)]
        st.manifest_path.write_bytes(orjson.dumps(m))


def test_a_store_at_its_token_window_keeps_a_small_manifest_and_still_spots_replays(tmp_path):
    # a collector flushing every 2 s fills the 10k insert-token window in under six hours; kept
    # one by one the tokens were ~600 KB of manifest, read twice, written and fsynced on every
    # flush from then on, their ~10k lists setting off GC collections that walk every object of
    # the process. Kept as runs of a spool's consecutive segment numbers they are one entry.
    import gc

    spool = "a9ed" * 8
    st = _fill(str(tmp_path / "s"), n=3, token="first")
    _legacy_window(st, st.token_window - 1)  # the window full: "first", then the spool's 1 ... 9,999
    assert st.manifest_path.stat().st_size > 500_000  # as an older ttftscope left it
    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        got = st._read_manifest()
    finally:
        gc.callbacks.remove(seen)
    # (at most the one young-generation pass that the lists made meanwhile set off once the GC is
    # back on: it walks them alone, not the process's every object)
    assert collections in ([], [0]), f"the read set off GC collections of generations {collections}"
    assert gc.isenabled(), "the GC is on again after the read"
    gc.disable()  # a GC someone else turned off stays off
    try:
        st._read_manifest()
        assert not gc.isenabled()
    finally:
        gc.enable()
    from ttftscope.schemas.store import tokens as tk

    # read as runs: the same window
    assert tk.tokens(got["token_runs"]) == ["first"] + [f"{spool}-{i}" for i in range(1, st.token_window)]
    # the next flush of the same spool: the window full, the oldest token forgotten, the manifest small
    before = st.query("SELECT count() FROM otel_traces").item()
    _fill(str(tmp_path / "s"), n=2, token=f"{spool}-{st.token_window}")
    assert st.query("SELECT count() FROM otel_traces").item() == before + 2
    assert st.manifest_path.stat().st_size < 2_000, st.manifest_path.stat().st_size
    m = st.manifest()
    assert m["tokens"] == [] and tk.size(m["token_runs"]) == st.token_window
    assert tk.tokens(m["token_runs"]) == [f"{spool}-{i}" for i in range(1, st.token_window + 1)]
    # replays of the newest, the oldest kept and a middle one are spotted; "first", forgotten, is not
    for replay in (st.token_window, 1, 5_000):
        _fill(str(tmp_path / "s"), n=2, token=f"{spool}-{replay}")
    assert st.query("SELECT count() FROM otel_traces").item() == before + 2
    assert _fill(str(tmp_path / "s"), n=2, token="first").query("SELECT count() FROM otel_traces").item() \
        == before + 4
    # the replays' parts were written and dropped: every part file on disk is one the manifest names
    files = {f.stem for f in st.parts_dir.glob("*.parquet")} - {"_empty"}
    assert files == {p["name"] for p in st.manifest()["parts"]}


def test_the_token_window_keeps_the_newest_tokens_as_one_by_one_would():
    """Runs against the window kept one by one (a deque of the last N): a collector's spool with
    gaps in its numbering, restarts under new spool ids (or an old one), tokens of no spool form;
    then collectors committing in turn (the order across runs is by time: exact at even rates)."""
    import collections
    import random

    from ttftscope.schemas.store import tokens as tk

    rng = random.Random(7)
    for window in (1, 5, 64):
        runs, ref, t, sid, seq, pairs = [], collections.deque(maxlen=window), 0.0, "aa", 0, []
        for _ in range(2_000):
            t += rng.choice((0.5, 2.0, 7.0))
            r = rng.random()
            if r < 0.03:  # a restart: a new spool id (one with a dash in it too), after a token of no
                # spool form (a store written by hand), or the same id numbering on (segments were left over)
                if rng.random() < 0.7:
                    sid, seq = rng.choice(("bb-", "cc-1-")) + str(rng.randrange(10**9)), 0
                    token = rng.choice(("bench", "t-007", "x-", f"plain{rng.randrange(10**6)}"))
                else:
                    seq += 1
                    token = f"{sid}-{seq}"
            else:  # the next segment, now and then a few numbers on (segments with nothing to store)
                seq += rng.choice((2, 3)) if rng.random() < 0.1 else 1
                token = f"{sid}-{seq}"
            if token in ref:
                assert tk.contains(runs, token)
                continue
            assert not tk.contains(runs, token), token
            tk.add(runs, token, t, window)
            ref.append(token)
            pairs.append([token, t])
            assert sorted(tk.tokens(runs)) == sorted(ref), (window, token)
            assert tk.valid(runs) and tk.size(runs) == len(ref)
        # the same window from the pairs at once (an older manifest read; a lost one rebuilt)
        assert sorted(tk.tokens(tk.from_pairs(pairs, window))) == sorted(ref)
    # several collectors on one store, committing in turn: one run each, the newest kept by time
    runs, ref = [], collections.deque(maxlen=300)
    for i in range(1, 1_001):
        for w, sid in enumerate(("c0", "c1", "c2")):
            tk.add(runs, f"{sid}-{i}", 10.0 * i + w, 300)
            ref.append(f"{sid}-{i}")
    assert len(runs) == 3 and sorted(tk.tokens(runs)) == sorted(ref)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_stop_signal_dropped_in_a_finalizer_still_stops_the_command():
    """Seen once in CI: ``kill -INT`` reached the demo while a weakref finalizer ran, Python
    printed its KeyboardInterrupt ("Exception ignored in: <finalize object>") and dropped it, and
    the demo ran on to its end (exit 0, not 130). The demo's, ``run``'s and ``sweep``'s handler
    remembers the signal, and the next step raises it again."""
    import gc
    import weakref

    from ttftscope import servers
    from ttftscope.demo import _say

    servers.INTERRUPTED.clear()
    try:
        class Held:
            pass

        h = Held()
        weakref.finalize(h, servers.interrupt, signal.SIGINT, None)
        del h  # the handler runs inside the finalizer: its KeyboardInterrupt is dropped here ...
        gc.collect()
        with pytest.raises(KeyboardInterrupt):  # ... and raised at the command's next step
            _say("4/6", "the next step")
    finally:
        servers.INTERRUPTED.clear()
