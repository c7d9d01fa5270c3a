"""DDL for the store, column-compatible with the OpenTelemetry Collector's ClickHouse
exporter, for one node or a cluster, with optional TTL; plus versioned migrations.

``migrations(...)`` is the ordered list every store applies idempotently at start-up;
``MIGRATIONS_TABLE`` records what was applied so a later change can migrate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRACES = "otel_traces"
TRACE_ID_TS = "otel_traces_trace_id_ts"
TRACE_ID_TS_MV = "otel_traces_trace_id_ts_mv"
MIGRATIONS_TABLE = "ttftscope_schema_migrations"
SCHEMA_VERSION = 1

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _ident(name: str, what: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"invalid {what} {name!r}: use letters, digits and underscores")
    return name


@dataclass(frozen=True)
class DDLOptions:
    database: str = "default"
    cluster: str | None = None  # ON CLUSTER name -> Replicated engines + Distributed tables
    ttl_days: int | None = None  # drop whole parts older than this
    #: ZooKeeper path template for Replicated engines (ClickHouse macros expand it)
    zk_path: str = "/clickhouse/tables/{shard}/{database}/{table}"
    replica: str = "{replica}"

    @property
    def on_cluster(self) -> str:
        """`` ON CLUSTER c`` for DDL on a cluster, empty on one node."""
        return f" ON CLUSTER {self.cluster}" if self.cluster else ""

    def local(self, table: str) -> str:
        """Name of the physical table: ``x`` on one node, ``x_local`` under a Distributed ``x``."""
        return f"{table}_local" if self.cluster else table

    def __post_init__(self) -> None:
        _ident(self.database, "database name")
        if self.cluster is not None:
            _ident(self.cluster, "cluster name")
        if self.ttl_days is not None and (int(self.ttl_days) != self.ttl_days or self.ttl_days < 1):
            raise ValueError(f"ttl_days must be a positive integer, got {self.ttl_days!r}")


def _engine(o: DDLOptions, kind: str, table: str) -> str:
    """``MergeTree`` / ``AggregatingMergeTree``, or their Replicated variants on a cluster."""
    if not o.cluster:
        return kind
    # {shard}, {replica}, {database} and {table} are ClickHouse macros, expanded per server
    return f"Replicated{kind}('{o.zk_path}', '{o.replica}')"


def traces_table(o: DDLOptions) -> str:
    t = o.local(TRACES)
    ttl = f"\nTTL toDateTime(Timestamp) + toIntervalDay({int(o.ttl_days)})" if o.ttl_days else ""
    dedup = "" if o.cluster else ", non_replicated_deduplication_window = 10000"
    return f"""CREATE TABLE IF NOT EXISTS {o.database}.{t}{o.on_cluster}
(
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(T64, ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested
    (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested
    (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    ResourceAttributeItems Array(String) ALIAS arrayMap((k, v) -> concat(k, '=', v), mapKeys(ResourceAttributes), mapValues(ResourceAttributes)),
    SpanAttributeItems Array(String) ALIAS arrayMap((k, v) -> concat(k, '=', v), mapKeys(SpanAttributes), mapValues(SpanAttributes)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1,
    INDEX idx_lower_span_name lower(SpanName) TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 1
)
ENGINE = {_engine(o, "MergeTree", t)}
PARTITION BY toDate(Timestamp)
PRIMARY KEY (ServiceName, SpanName, toDateTime(Timestamp))
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp){ttl}
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1{dedup}"""


def trace_id_ts_table(o: DDLOptions) -> str:
    t = o.local(TRACE_ID_TS)
    ttl = f"\nTTL toDateTime(Start) + toIntervalDay({int(o.ttl_days)})" if o.ttl_days else ""
    return f"""CREATE TABLE IF NOT EXISTS {o.database}.{t}{o.on_cluster}
(
    TraceId String CODEC(ZSTD(1)),
    Start SimpleAggregateFunction(min, DateTime) CODEC(ZSTD(1)),
    End SimpleAggregateFunction(max, DateTime) CODEC(ZSTD(1))
)
ENGINE = {_engine(o, "AggregatingMergeTree", t)}
PARTITION BY toStartOfWeek(Start)
ORDER BY (TraceId){ttl}
SETTINGS index_granularity = 8192"""


def trace_id_ts_view(o: DDLOptions) -> str:
    src, dst = o.local(TRACES), o.local(TRACE_ID_TS)
    return f"""CREATE MATERIALIZED VIEW IF NOT EXISTS {o.database}.{TRACE_ID_TS_MV}{o.on_cluster}
TO {o.database}.{dst}
AS SELECT
    TraceId,
    min(Timestamp) AS Start,
    max(Timestamp) AS End
FROM {o.database}.{src}
WHERE TraceId != ''
GROUP BY TraceId"""


def distributed_tables(o: DDLOptions) -> list[str]:
    if not o.cluster:
        return []
    return [
        f"CREATE TABLE IF NOT EXISTS {o.database}.{TRACES}{o.on_cluster} "
        f"AS {o.database}.{TRACES}_local "
        f"ENGINE = Distributed({o.cluster}, {o.database}, {TRACES}_local, cityHash64(TraceId))",
        f"CREATE TABLE IF NOT EXISTS {o.database}.{TRACE_ID_TS}{o.on_cluster} "
        f"AS {o.database}.{TRACE_ID_TS}_local "
        f"ENGINE = Distributed({o.cluster}, {o.database}, {TRACE_ID_TS}_local, cityHash64(TraceId))",
    ]


def migrations_table(o: DDLOptions) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {o.database}.{MIGRATIONS_TABLE}{o.on_cluster}
(
    version UInt32,
    description String,
    applied_at DateTime DEFAULT now()
)
ENGINE = {_engine(o, "ReplacingMergeTree", MIGRATIONS_TABLE)}
ORDER BY version"""


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


def migrations(o: DDLOptions) -> list[Migration]:
    """All migrations in order. Each statement is idempotent (IF NOT EXISTS)."""
    create = [f"CREATE DATABASE IF NOT EXISTS {o.database}{o.on_cluster}"]
    return [
        Migration(
            1,
            "otel_traces, otel_traces_trace_id_ts and its materialized view",
            tuple(
                create
                + [traces_table(o), trace_id_ts_table(o), trace_id_ts_view(o)]
                + distributed_tables(o)
            ),
        ),
    ]


def all_statements(o: DDLOptions) -> list[str]:
    """Every statement, for ``ttftscope schema ddl`` and for review."""
    out = [f"CREATE DATABASE IF NOT EXISTS {o.database}{o.on_cluster}", migrations_table(o)]
    for m in migrations(o):
        out.extend(s for s in m.statements if not s.startswith("CREATE DATABASE"))
    return out
