"""The data contract: DDL runs on real ClickHouse (chDB) and matches the exporter's columns."""

from __future__ import annotations

import datetime
import subprocess
import tempfile

import pytest
from conftest import PY, ROOT

# The OpenTelemetry Collector ClickHouse exporter's otel_traces columns, in INSERT order
# (shared/reference/otel-clickhouse-grafana.md).
EXPORTER_COLUMNS = [
    ("Timestamp", "DateTime64(9)"),
    ("TraceId", "String"),
    ("SpanId", "String"),
    ("ParentSpanId", "String"),
    ("TraceState", "String"),
    ("SpanName", "LowCardinality(String)"),
    ("SpanKind", "LowCardinality(String)"),
    ("ServiceName", "LowCardinality(String)"),
    ("ResourceAttributes", "Map(LowCardinality(String), String)"),
    ("ScopeName", "String"),
    ("ScopeVersion", "String"),
    ("SpanAttributes", "Map(LowCardinality(String), String)"),
    ("Duration", "UInt64"),
    ("StatusCode", "LowCardinality(String)"),
    ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9))"),
    ("Events.Name", "Array(LowCardinality(String))"),
    ("Events.Attributes", "Array(Map(LowCardinality(String), String))"),
    ("Links.TraceId", "Array(String)"),
    ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"),
    ("Links.Attributes", "Array(Map(LowCardinality(String), String))"),
]

_DDL_PROBE = r"""
import json, sys
from chdb import session
from ttftscope.schemas import ddl
s = session.Session(sys.argv[1])
o = ddl.DDLOptions(database="tt", ttl_days=3)
for _ in range(2):  # applying twice is harmless (idempotent)
    for st in ddl.all_statements(o):
        s.query(st)
cols = s.query("SELECT name, type, default_kind FROM system.columns WHERE database='tt' AND table='otel_traces' ORDER BY position", "JSONCompact").bytes()
create = s.query("SHOW CREATE TABLE tt.otel_traces", "TSVRaw").bytes().decode()
lookup = s.query("SELECT name, type FROM system.columns WHERE database='tt' AND table='otel_traces_trace_id_ts' ORDER BY position", "JSONCompact").bytes()
day = sys.argv[2]
s.query("INSERT INTO tt.otel_traces (Timestamp, TraceId, SpanId, SpanName) VALUES "
        f"('{day} 00:00:01.5', 'aa', '01', 'x'), ('{day} 00:00:09.5', 'aa', '02', 'y'), ('{day} 03:00:00', 'bb', '03', 'z')")
mv = s.query("SELECT TraceId, toString(min(Start)), toString(max(End)) FROM tt.otel_traces_trace_id_ts GROUP BY TraceId ORDER BY TraceId", "JSONCompact").bytes()
print(json.dumps({"cols": json.loads(cols)["data"], "create": create, "lookup": json.loads(lookup)["data"], "mv": json.loads(mv)["data"]}))
"""


@pytest.fixture(scope="module")
def probe():
    import json

    with tempfile.TemporaryDirectory() as d:
        day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()  # inside the TTL
        r = subprocess.run([PY, "-c", _DDL_PROBE, d, day], capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        return {**json.loads(r.stdout), "day": day}


def test_otel_traces_columns_match_the_exporter(probe):
    physical = [(n, t) for n, t, kind in probe["cols"] if kind != "ALIAS"]
    assert physical == EXPORTER_COLUMNS
    aliases = {n for n, _, kind in probe["cols"] if kind == "ALIAS"}
    assert aliases == {"ResourceAttributeItems", "SpanAttributeItems"}


def test_table_layout_and_ttl(probe):
    c = probe["create"]
    for frag in ["PARTITION BY toDate(Timestamp)", "PRIMARY KEY (ServiceName, SpanName, toDateTime(Timestamp))",
                 "ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp)",
                 "TTL toDateTime(Timestamp) + toIntervalDay(3)", "ttl_only_drop_parts = 1",
                 "INDEX idx_trace_id TraceId TYPE bloom_filter(0.001)", "CODEC(Delta(8), ZSTD(1))",
                 "CODEC(T64, ZSTD(1))"]:
        assert frag in c, frag


def test_trace_id_lookup_table_fed_by_the_materialized_view(probe):
    assert probe["lookup"] == [["TraceId", "String"], ["Start", "SimpleAggregateFunction(min, DateTime)"],
                               ["End", "SimpleAggregateFunction(max, DateTime)"]]
    d = probe["day"]
    assert probe["mv"] == [["aa", f"{d} 00:00:01", f"{d} 00:00:09"], ["bb", f"{d} 03:00:00", f"{d} 03:00:00"]]


def test_cluster_variant_uses_replicated_and_distributed_tables():
    from ttftscope.schemas import ddl

    sts = ddl.all_statements(ddl.DDLOptions(database="obs", cluster="prod", ttl_days=14))
    text = "\n".join(sts)
    assert all(" ON CLUSTER prod" in s for s in sts if s.startswith("CREATE"))
    assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')" in text
    assert "ReplicatedAggregatingMergeTree" in text
    assert "ENGINE = Distributed(prod, obs, otel_traces_local, cityHash64(TraceId))" in text
    assert "TO obs.otel_traces_trace_id_ts_local" in text and "FROM obs.otel_traces_local" in text


@pytest.mark.parametrize("kw, msg", [({"database": "x; DROP"}, "invalid database"),
                                     ({"cluster": "a b"}, "invalid cluster"),
                                     ({"ttl_days": 0}, "ttl_days")])
def test_ddl_options_are_validated(kw, msg):
    from ttftscope.schemas import ddl

    with pytest.raises(ValueError, match=msg):
        ddl.DDLOptions(**kw)


def test_schema_cli_prints_ddl_and_vocabulary():
    r = subprocess.run([PY, "-m", "ttftscope", "schema", "ddl", "--cluster", "c1"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "ON CLUSTER c1" in r.stdout
    r = subprocess.run([PY, "-m", "ttftscope", "schema", "vocabulary"], capture_output=True, text=True, cwd=ROOT)
    import json

    v = json.loads(r.stdout)
    assert v["phases"] == ["load", "receive", "tokenize", "intake", "queue", "prefill", "allreduce", "deliver", "gap"]


def test_phase_mapping_sql_agrees_with_python(tmp_path):
    """The SQL phase expression (analyzer, dashboards) and the Python mapping are one vocabulary."""
    import time

    from ttftscope.collector.otlp import SpanBatchBuilder
    from ttftscope.schemas import phases as v
    from ttftscope.schemas.store import open_store
    from ttftscope.schemas.vocabulary import Attr

    names = list(v.SPAN_PHASE) + ["llm_request", "something else"]
    b = SpanBatchBuilder()
    now = time.time_ns()
    for i, n in enumerate(names):
        b.add_span(start=now, end=now + 1, trace_id=f"{i + 1:032x}", span_id=f"{i + 1:016x}", parent="",
                   trace_state="", name=n, kind="Internal", service="s", resource={}, scope_name="",
                   scope_version="", attrs={}, status="Unset", status_msg="", events=[], links=[])
    # an explicit phase attribute wins over the name
    b.add_span(start=now, end=now + 1, trace_id=f"{999:032x}", span_id=f"{999:016x}", parent="", trace_state="",
               name="custom.thing", kind="Internal", service="s", resource={}, scope_name="", scope_version="",
               attrs={Attr.PHASE: "tokenize"}, status="Unset", status_msg="", events=[], links=[])
    st = open_store(str(tmp_path / "s"))
    st.insert_spans(b.table(), "t")
    got = dict(st.query(f"SELECT SpanName, {v.phase_sql()} AS phase FROM otel_traces").iter_rows())
    for n in names:
        assert got[n] == (v.phase_of(n) or ""), n
    assert got["custom.thing"] == "tokenize"


def test_every_phase_is_derived_from_the_registry():
    """Adding a phase is one PhaseSpec: the UI's and Grafana's colours and the span mapping (SQL
    and Python) follow it (the decomposition's columns: test_analyzer's exact-sum test)."""
    import json

    from ttftscope.dashboards import grafana
    from ttftscope.schemas import phases

    names = [p.name for p in phases.REGISTRY]
    assert all(phases.COLOURS[n].startswith("#") and phases.LABELS[n] for n in names)
    assert len({phases.COLOURS[n] for n in names}) == len(names), "one colour per phase"
    for p in phases.REGISTRY:
        for s in (*p.spans, *p.vllm_spans):
            assert phases.phase_of(s) == p.name and f"'{s}'" in phases.phase_sql()
    overview = json.dumps(grafana.overview())
    for n in names:
        assert phases.COLOURS[n] in overview, n


def test_a_load_test_result_is_stored_as_one_span_with_its_numbers(tmp_path):
    """`ttftscope run` / sweep keep the benchmark's own numbers next to the traces."""
    from ttftscope.schemas.store import open_store
    from ttftscope.schemas.vocabulary import Attr, ResourceAttr, SpanName

    from ttftscope.sweep import record_loadtest

    st = open_store(str(tmp_path / "s"))
    lo = 1_750_000_000_000_000_000
    record_loadtest(st, {"window_ns": (lo, lo + 30 * 10**9), "ttft_p50_ms": 16.4, "completed": 120, "report": {},
                         "classes": {"0": {"ttft_p99_ms": 30.5}}}, {"run": "r1", "max_num_seqs": 8})
    row = st.query("SELECT SpanName, Duration, SpanAttributes AS a, ResourceAttributes AS r, "
                   "toUnixTimestamp64Nano(Timestamp) AS ts FROM otel_traces").row(0, named=True)
    a, r = dict(row["a"]), dict(row["r"])
    assert row["SpanName"] == SpanName.LOADTEST and row["ts"] == lo and row["Duration"] == 30 * 10**9
    assert a[f"{Attr.LOADTEST}.ttft_p50_ms"] == "16.4" and a[f"{Attr.LOADTEST}.completed"] == "120"
    assert a[f"{Attr.LOADTEST}.priority.0.ttft_p99_ms"] == "30.5"
    assert a[f"{Attr.LOADTEST}.setting.max_num_seqs"] == "8" and r[ResourceAttr.RUN] == "r1"
    assert not any(k.endswith(".report") for k in a)


_IDLE_ENGINE = r"""
import os, time
from ttftscope.schemas import engine
with engine.LOCK:
    engine.session().query("SELECT 1", "CSV")
def wakeups():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except FileNotFoundError:
            continue
        n = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        out[name] = out.get(name, 0) + n
    return out
a = wakeups()
time.sleep(3)
b = wakeups()
print(b.get("MemoryWorker", -1) - a.get("MemoryWorker", 0) if "MemoryWorker" in b else "absent")
"""


def test_an_idle_engine_wakes_about_once_a_second_not_twenty_times():
    """chDB's ClickHouse runs a memory worker thread (nice -20) that reads the cgroup's memory
    use on every tick, queries or none: by default every 50 ms, 20 wake-ups a second in every
    process with an engine (an idle collector or UI beside vLLM). The product's engine ticks
    once a second: counted by the kernel (the thread's voluntary context switches) over 3 s of
    idling, in a process of its own."""
    out = subprocess.run([PY, "-c", _IDLE_ENGINE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = out.stdout.strip().splitlines()[-1]
    if got == "absent":  # a chDB without the worker (no cgroup or jemalloc source): nothing wakes
        return
    assert int(got) <= 8, f"the memory worker woke {got} times in 3 s of idling (50-ms ticks: ~60)"
