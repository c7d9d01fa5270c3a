"""Stock OpenTelemetry SDK -> `ttftscope collect` -> `ttftscope sql`: every field intact."""

from __future__ import annotations

import json
import math

import pytest
from conftest import ttftscope_sql

from support.otlp import emit_rich_spans

KIND = {0: "Internal", 1: "Server", 2: "Client", 3: "Producer", 4: "Consumer"}  # SDK SpanKind values
STATUS = {"UNSET": "Unset", "OK": "Ok", "ERROR": "Error"}

SELECT = """
SELECT TraceId, SpanId, ParentSpanId, TraceState, SpanName, SpanKind, ServiceName,
       ResourceAttributes, ScopeName, ScopeVersion, SpanAttributes,
       toString(Duration) AS dur, StatusCode, StatusMessage,
       toString(toUnixTimestamp64Nano(Timestamp)) AS ts,
       arrayMap(x -> toString(toUnixTimestamp64Nano(x)), Events.Timestamp) AS ev_ts,
       Events.Name AS ev_name, Events.Attributes AS ev_attrs,
       Links.TraceId AS ln_trace, Links.SpanId AS ln_span, Links.TraceState AS ln_state,
       Links.Attributes AS ln_attrs
FROM otel_traces WHERE ServiceName = {svc:String}
"""


def _go_float(v: float) -> str:
    """What the OTel Collector's pcommon writes for a double (strconv 'f', -1)."""
    if v == math.floor(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _expected_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _go_float(v)
    if isinstance(v, str):
        return v
    return json.dumps(list(v), separators=(",", ":"), ensure_ascii=False)


def _attrs(a) -> dict:
    return {k: _expected_value(v) for k, v in dict(a or {}).items()}


def _check(sdk_spans, rows) -> None:
    by_id = {r["SpanId"]: r for r in rows}
    assert len(rows) == len(sdk_spans), "every span stored exactly once"
    for s in sdk_spans:
        r = by_id[format(s.context.span_id, "016x")]
        assert r["TraceId"] == format(s.context.trace_id, "032x")
        assert r["ParentSpanId"] == (format(s.parent.span_id, "016x") if s.parent else "")
        assert r["TraceState"] == ""
        assert r["SpanName"] == s.name
        assert r["SpanKind"] == KIND[s.kind.value]
        assert r["ServiceName"] == s.resource.attributes["service.name"]
        assert r["ResourceAttributes"] == _attrs(s.resource.attributes)
        assert (r["ScopeName"], r["ScopeVersion"]) == (s.instrumentation_scope.name, s.instrumentation_scope.version)
        assert r["SpanAttributes"] == _attrs(s.attributes)
        assert int(r["ts"]) == s.start_time, "nanosecond start time"
        assert int(r["dur"]) == s.end_time - s.start_time, "nanosecond duration"
        assert r["StatusCode"] == STATUS[s.status.status_code.name]
        assert r["StatusMessage"] == (s.status.description or "")
        assert r["ev_name"] == [e.name for e in s.events]
        assert [int(t) for t in r["ev_ts"]] == [e.timestamp for e in s.events]
        assert r["ev_attrs"] == [_attrs(e.attributes) for e in s.events]
        assert r["ln_trace"] == [format(lk.context.trace_id, "032x") for lk in s.links]
        assert r["ln_span"] == [format(lk.context.span_id, "016x") for lk in s.links]
        assert r["ln_state"] == ["" for _ in s.links]
        assert r["ln_attrs"] == [_attrs(lk.attributes) for lk in s.links]


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
@pytest.mark.parametrize("compression", ["none", "gzip", "deflate"])
def test_sdk_spans_round_trip_embedded(collector_factory, encoding, compression):
    col = collector_factory().start()
    svc = f"svc-{encoding}-{compression}"
    sdk_spans = emit_rich_spans(col.url, encoding, svc, n=15, compression=compression)
    assert col.terminate() == 0, col.output()  # SIGTERM flushes everything acknowledged
    rows = ttftscope_sql(col.store, SELECT, params={"svc": svc})
    _check(sdk_spans, rows)
    kinds = {r["SpanKind"] for r in rows}
    assert kinds == {"Server", "Internal", "Client"}
    assert {r["StatusCode"] for r in rows} == {"Ok", "Unset", "Error"}


def test_sdk_spans_round_trip_clickhouse_server(collector_factory, clickhouse):
    """The server path: clickhouse-connect over HTTP into real MergeTree tables."""
    url = clickhouse.url("ttft")
    col = collector_factory(store=url).start()
    sdk_spans = emit_rich_spans(col.url, "protobuf", "svc-ch", n=10)
    assert col.terminate() == 0, col.output()
    rows = ttftscope_sql(url, SELECT, params={"svc": "svc-ch"})
    _check(sdk_spans, rows)
    # the materialized view fed the trace-id lookup table Grafana uses
    tid = rows[0]["TraceId"]
    look = ttftscope_sql(url, "SELECT TraceId, min(Start) s, max(End) e FROM otel_traces_trace_id_ts "
                              "WHERE TraceId = {t:String} GROUP BY TraceId", params={"t": tid})
    assert len(look) == 1 and look[0]["s"] <= look[0]["e"]
    tables = {r["name"] for r in ttftscope_sql(url, "SELECT name FROM system.tables WHERE database = 'ttft'")}
    assert {"otel_traces", "otel_traces_trace_id_ts", "otel_traces_trace_id_ts_mv",
            "ttftscope_schema_migrations"} <= tables
