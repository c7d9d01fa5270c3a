"""Columns of ``otel_traces``, defined once, as the OpenTelemetry Collector's ClickHouse
exporter writes them (names, types, INSERT order). The DDL, the Arrow batches the collector
builds, and the embedded store's read views are all generated from this list.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

TS = pa.timestamp("ns", tz="UTC")
STR_MAP = pa.map_(pa.string(), pa.string())
LC_MAP = "Map(LowCardinality(String), String)"


@dataclass(frozen=True)
class Column:
    name: str  # flattened name, as in the exporter's INSERT (``Events.Timestamp``)
    ch_type: str  # ClickHouse type of the flattened column
    arrow: pa.DataType


#: Flattened columns in the exporter's INSERT order.
SPAN_COLUMNS: tuple[Column, ...] = (
    Column("Timestamp", "DateTime64(9)", TS),
    Column("TraceId", "String", pa.string()),
    Column("SpanId", "String", pa.string()),
    Column("ParentSpanId", "String", pa.string()),
    Column("TraceState", "String", pa.string()),
    Column("SpanName", "LowCardinality(String)", pa.string()),
    Column("SpanKind", "LowCardinality(String)", pa.string()),
    Column("ServiceName", "LowCardinality(String)", pa.string()),
    Column("ResourceAttributes", LC_MAP, STR_MAP),
    Column("ScopeName", "String", pa.string()),
    Column("ScopeVersion", "String", pa.string()),
    Column("SpanAttributes", LC_MAP, STR_MAP),
    Column("Duration", "UInt64", pa.uint64()),
    Column("StatusCode", "LowCardinality(String)", pa.string()),
    Column("StatusMessage", "String", pa.string()),
    Column("Events.Timestamp", "Array(DateTime64(9))", pa.list_(TS)),
    Column("Events.Name", "Array(LowCardinality(String))", pa.list_(pa.string())),
    Column("Events.Attributes", f"Array({LC_MAP})", pa.list_(STR_MAP)),
    Column("Links.TraceId", "Array(String)", pa.list_(pa.string())),
    Column("Links.SpanId", "Array(String)", pa.list_(pa.string())),
    Column("Links.TraceState", "Array(String)", pa.list_(pa.string())),
    Column("Links.Attributes", f"Array({LC_MAP})", pa.list_(STR_MAP)),
)

COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in SPAN_COLUMNS)
ARROW_SCHEMA: pa.Schema = pa.schema([pa.field(c.name, c.arrow) for c in SPAN_COLUMNS])


def clickhouse_structure() -> str:
    """``name Type, ...`` for ClickHouse table functions (``file(..., structure)``)."""
    return ", ".join(f"`{c.name}` {c.ch_type}" for c in SPAN_COLUMNS)


def empty_table() -> pa.Table:
    return ARROW_SCHEMA.empty_table()


def spans_table(spans: list[dict]) -> pa.Table:
    """A few spans written by ttftscope itself (a load test's result, say) as ``otel_traces``
    rows: each a dict of column values (maps as dicts, ``Timestamp`` in ns since the epoch);
    columns not given are empty. Incoming OTLP goes through the collector, not here."""
    blank = {c.name: ([] if pa.types.is_list(c.arrow) else {} if pa.types.is_map(c.arrow) else
                      0 if c.name in ("Timestamp", "Duration") else "") for c in SPAN_COLUMNS}
    rows = [{k: (list(v.items()) if isinstance(v, dict) else v) for k, v in {**blank, **s}.items()} for s in spans]
    return pa.Table.from_pylist(rows, schema=pa.schema([pa.field(f.name, pa.int64() if f.name == "Timestamp" else f.type)
                                                       for f in ARROW_SCHEMA])).cast(ARROW_SCHEMA)
