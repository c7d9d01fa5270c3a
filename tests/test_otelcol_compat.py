"""The stock OpenTelemetry Collector can replace `ttftscope collect` (collector/otelcol-clickhouse.yaml).

What the OpenTelemetry Collector's ClickHouse exporter does is written down here from its
source (opentelemetry-collector-contrib, exporter/clickhouseexporter/internal/sql_templates/
traces_table.sql and traces_insert.sql at ff7a94656bd04ce95228ff4282554a233ed93434): the
columns it INSERTs, in order, and the type each has in the table it creates when
``create_schema`` is on. Checked here, against a real ClickHouse engine (chDB behind the
HTTP fixture):
  1. the example config is wired as its comments say (OTLP/HTTP in, the exporter writing
     ``otel_traces`` in the database the DDL creates, without creating its own schema);
  2. the table ttftscope's DDL creates takes every column the exporter inserts, with the
     exporter's types (read back with DESCRIBE, not from our own constants);
  3. a table the exporter created itself, filled in the exporter's column order, gives the
     analyzer the same report as the embedded store holding the same spans.
"""

from __future__ import annotations

import json
import subprocess

import clickhouse_connect
import yaml
from conftest import PY, ROOT

LC_MAP = "Map(LowCardinality(String), String)"
#: (column, type) in the exporter's INSERT order; Events/Links are Nested in its table,
#: stored (and inserted) as the flattened arrays below
EXPORTER_COLUMNS = [
    ("Timestamp", "DateTime64(9)"), ("TraceId", "String"), ("SpanId", "String"), ("ParentSpanId", "String"),
    ("TraceState", "String"), ("SpanName", "LowCardinality(String)"), ("SpanKind", "LowCardinality(String)"),
    ("ServiceName", "LowCardinality(String)"), ("ResourceAttributes", LC_MAP), ("ScopeName", "String"),
    ("ScopeVersion", "String"), ("SpanAttributes", LC_MAP), ("Duration", "UInt64"),
    ("StatusCode", "LowCardinality(String)"), ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9))"), ("Events.Name", "Array(LowCardinality(String))"),
    ("Events.Attributes", f"Array({LC_MAP})"), ("Links.TraceId", "Array(String)"), ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"), ("Links.Attributes", f"Array({LC_MAP})"),
]
CONFIG = ROOT / "collector" / "otelcol-clickhouse.yaml"


def _exporter_table_ddl(db: str) -> str:
    """The table the exporter creates (create_schema: true), engine and keys as it sets them."""
    cols = []
    for name, typ in EXPORTER_COLUMNS:
        if "." not in name:
            cols.append(f"`{name}` {typ}")
    cols.append("`Events` Nested(`Timestamp` DateTime64(9), `Name` LowCardinality(String), `Attributes` " + LC_MAP + ")")
    cols.append("`Links` Nested(`TraceId` String, `SpanId` String, `TraceState` String, `Attributes` " + LC_MAP + ")")
    return (f"CREATE TABLE {db}.otel_traces ({', '.join(cols)}) ENGINE = MergeTree "
            "PARTITION BY toDate(Timestamp) ORDER BY (ServiceName, SpanName, toDateTime(Timestamp))")


def _client(ch, db: str = "default"):
    return clickhouse_connect.get_client(host="127.0.0.1", port=ch.port, username="default", database=db)


def test_example_config_is_wired_as_documented():
    cfg = yaml.safe_load(CONFIG.read_text())
    assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    ch = cfg["exporters"]["clickhouse"]
    assert ch["traces_table_name"] == "otel_traces" and ch["create_schema"] is False
    pipe = cfg["service"]["pipelines"]["traces"]
    assert pipe["receivers"] == ["otlp"] and pipe["exporters"] == ["clickhouse"]
    assert set(pipe["processors"]) <= set(cfg["processors"])
    # the database the comments tell users to create is the one the exporter writes to
    assert f"--database {ch['database']}" in CONFIG.read_text()


def test_our_ddl_takes_every_column_the_exporter_inserts(clickhouse):
    db = yaml.safe_load(CONFIG.read_text())["exporters"]["clickhouse"]["database"]
    ddl = subprocess.run([PY, "-m", "ttftscope", "schema", "ddl", "--database", db],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    c = _client(clickhouse)
    for stmt in (s.strip() for s in ddl.split(";")):
        if stmt and not all(line.lstrip().startswith("--") for line in stmt.splitlines()):
            c.command(stmt)
    described = {r[0]: r[1] for r in c.query(f"DESCRIBE TABLE {db}.otel_traces SETTINGS flatten_nested = 1").result_rows}
    for name, typ in EXPORTER_COLUMNS:
        assert name in described, f"the exporter inserts {name}; our table has no such column"
        assert described[name] == typ, f"{name}: exporter {typ}, ours {described[name]}"


def test_analyzer_reads_a_table_the_exporter_created(clickhouse, tmp_path):
    emb = str(tmp_path / "emb")
    subprocess.run([PY, "-m", "ttftscope", "synth", "--store", emb, "--scenario", "queue-surge", "--requests", "300",
                    "--seed", "3"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    from ttftscope.schemas.store import open_store

    spans = open_store(emb).query_arrow(
        "SELECT " + ", ".join(f"`{n}`" for n, _ in EXPORTER_COLUMNS) + " FROM otel_traces")
    c = _client(clickhouse)
    c.command("CREATE DATABASE exp")
    c.command(_exporter_table_ddl("exp"))
    c.insert_arrow("exp.otel_traces", spans)  # columns in the exporter's INSERT order
    assert c.query("SELECT count() FROM exp.otel_traces").result_rows[0][0] == spans.num_rows > 0

    def report(store: str) -> dict:
        r = subprocess.run([PY, "-m", "ttftscope", "analyze", "--store", store, "--last", "30d", "--json", "--quiet"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    ours, theirs = report(emb), report(clickhouse.url("exp"))
    assert theirs["requests"] == ours["requests"] > 0
    for key in ("ttft_ms", "phases", "gaps", "cold_start"):
        assert theirs[key] == ours[key], key
    assert [(f["kind"], round(f["size"], 9)) for f in theirs["findings"]] == [
        (f["kind"], round(f["size"], 9)) for f in ours["findings"]]
    assert ours["findings"][0]["kind"] == "queue_dominates"  # the planted cause, read from both tables
